"""Every use of a private torch API, in one place, so a torch upgrade breaks one module.

Tested by ``tests/core/state/test_torch_compat.py``: if a release moves one of these, that test
fails with the name of the symbol. ``tests/core/project/test_private_access.py`` fails if any
other module of the core touches a private name of torch.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

try:  # torch >= 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None  # type: ignore[assignment,misc]

try:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover
    ShardedTensor = None  # type: ignore[assignment,misc]


def is_dtensor(x: Any) -> TypeGuard[DTensor]:
    return isinstance(x, DTensor)


def local_shape(dt: DTensor) -> torch.Size:
    """The shape of a DTensor's local tensor (padding included), without ``to_local()``'s
    autograd node."""
    local = getattr(dt, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else dt.to_local()).shape


def local_tensor(dt: DTensor) -> torch.Tensor:
    """A DTensor's local tensor itself, whose storage is the shard's memory (``to_local()``
    may return an autograd view of it)."""
    return dt._local_tensor


def version(t: torch.Tensor) -> int:
    """``t``'s version counter, which every in-place change of ``t`` (or of a view sharing its
    counter) increments."""
    return int(t._version)


def is_zero_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a zero tensor: all zeros with no memory behind it (a gradient torch
    leaves unmaterialized)."""
    return bool(t._is_zerotensor())


def zero_all(tensors: list[torch.Tensor]) -> None:
    """Zero every tensor of ``tensors`` in one call, not one Python call each."""
    torch._foreach_zero_(tensors)


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    """``d.copy_(s)`` for each pair in one call (per-tensor Python overhead matters with many
    small tensors)."""
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def load_dcp_state_dict(sd: dict[str, Any], reader: Any, keys: set[str] | None) -> None:
    """Fill ``sd`` with what the DCP ``reader`` holds (only the flat DCP ``keys`` if given),
    in this process without a process group: full tensors, whatever the saving layout."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)


def is_sharded_tensor(x: Any) -> bool:
    return ShardedTensor is not None and isinstance(x, ShardedTensor)


def sharded_tensor_group_size(st: Any) -> int:
    """The size of the process group a ShardedTensor's placements name ranks of; -1 where
    that group cannot be found (its layout is then enumerated, never described)."""
    if not dist.is_initialized() or not hasattr(st, "_process_group"):
        return -1
    return int(dist.get_world_size(st._process_group))


def sharded_tensor_rank(st: Any) -> int:
    """This process's rank in a ShardedTensor's process group."""
    return int(dist.get_rank(st._process_group))


def is_shard_placement(p: Any) -> bool:
    return isinstance(p, Shard) or (_StridedShard is not None and isinstance(p, _StridedShard))


def is_replicate(p: Any) -> bool:
    return isinstance(p, Replicate)


def placement_rule(p: Any) -> tuple[Any, ...] | None:
    """A placement in the described-layout rule's terms (format/grid.py): ``("S", dim)`` for a
    plain Shard, ``("R",)`` for Replicate; None for any other (``_StridedShard``, Partial)."""
    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, Shard) and not (_StridedShard is not None and isinstance(p, _StridedShard)):
        return ("S", int(p.dim))
    return None


def strided_split_factor(p: Any) -> int | None:
    """A ``_StridedShard``'s split factor (FSDP2 over TP on one dimension), or None for any
    other placement."""
    if _StridedShard is not None and isinstance(p, _StridedShard):
        return int(p.split_factor)
    return None


def is_whole_world(world_size: int) -> bool:
    """Whether a saving group of ``world_size`` ranks is the default group's world (its ranks
    are then the global ranks a DeviceMesh lists)."""
    return dist.is_initialized() and dist.get_world_size() == world_size


def root_mesh(mesh: Any) -> Any:
    """The mesh a DeviceMesh was sliced from (itself when it was not sliced)."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


def submesh_dims(sub: Any, root: Any) -> tuple[int, ...] | None:
    """The dimension of ``root`` each dimension of its slice ``sub`` is, by name; None where
    one is not a dimension of ``root`` (a flattened one) or the meshes have no names."""
    names, root_names = sub.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or not set(names) <= set(root_names):
        return None
    return tuple(root_names.index(n) for n in names)


def mesh_ranks(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DeviceMesh's shape and the global rank at each coordinate, row-major."""
    ranks = mesh.mesh
    return tuple(int(s) for s in ranks.shape), tuple(int(r) for r in ranks.flatten().tolist())


def is_partial(p: Any) -> bool:
    return isinstance(p, Partial)


def shard_dim_indices(
    curr_local_size: int, mesh_dim_size: int, coord: int, placement: Any, previous: torch.Tensor | None
) -> tuple[int, torch.Tensor]:
    """Apply one Shard/_StridedShard placement to one tensor dimension.

    Returns the new local size and the global indices (along that dimension) of the local
    rows, composed with ``previous`` (the indices after earlier mesh dims).
    """
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    size, index = _get_shard_size_and_offsets(curr_local_size, mesh_dim_size, coord, placement, previous, 0, False)
    if size == 0:
        return 0, torch.empty(0, dtype=torch.long)
    assert index is not None
    return int(size), index


def default_store() -> Any:
    """The c10d store of the default process group: rendezvous keys, thread-safe, no collective."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def group_store(group: Any) -> Any:
    """The store for ``group`` (the default group's store, prefixed for other groups)."""
    if group is None or group == dist.group.WORLD:
        return default_store()
    from torch.distributed.distributed_c10d import _world

    pg_map = getattr(_world, "pg_map", {})
    entry = pg_map.get(group)
    if entry is not None and len(entry) > 1 and entry[1] is not None:
        return entry[1]
    return default_store()


__all__ = [
    "default_store",
    "group_store",
    "is_dtensor",
    "is_partial",
    "is_replicate",
    "is_shard_placement",
    "is_sharded_tensor",
    "sharded_tensor_group_size",
    "sharded_tensor_rank",
    "is_whole_world",
    "root_mesh",
    "submesh_dims",
    "local_shape",
    "local_tensor",
    "mesh_ranks",
    "copy_all",
    "is_zero_tensor",
    "load_dcp_state_dict",
    "version",
    "zero_all",
    "placement_rule",
    "strided_split_factor",
    "shard_dim_indices",
]
