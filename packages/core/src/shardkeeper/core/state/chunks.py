"""Where a rank's piece of a tensor lies in the global tensor.

Every tensor-like leaf (a plain tensor, a DTensor of any placements, a ShardedTensor) becomes
a global shape plus a list of *pieces*: boxes of the global tensor (offsets + shape), each with
the view of the local tensor that holds it. Shard and ``_StridedShard`` placements compose
per dimension, so a local shard is the outer product of one index list per dimension; each
list splits into contiguous runs, and the product of runs gives the boxes. A plain Shard gives
one box; a ``_StridedShard`` (FSDP2 over TP on the same dimension) gives a few.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.fragment import Fragment


@dataclass
class Piece:
    """A box of the global tensor held by this rank, and the local view that holds it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    local: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class LocalLayout:
    """This rank's view of one tensor leaf.

    ``replicas`` ranks hold identical pieces (DDP, Replicate mesh dims); ``replica_index`` is
    this rank's index among them. ``plain`` marks a tensor that is not distributed at all.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    replicas: int
    replica_index: int
    plain: bool


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a row-major (C-contiguous) tensor of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split global indices into contiguous runs: (global_start, local_start, length)."""
    n = index.numel()
    if n == 0:
        return []
    if n == 1 or int(index[-1]) - int(index[0]) == n - 1 and bool((index.diff() == 1).all()):
        return [(int(index[0]), 0, n)]
    breaks = (index.diff() != 1).nonzero().flatten().add(1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, n]
    return [(int(index[s]), s, e - s) for s, e in zip(starts, ends)]


def _pieces_from_dim_indices(
    local: torch.Tensor, global_shape: tuple[int, ...], dim_index: dict[int, torch.Tensor]
) -> list[Piece]:
    per_dim: list[list[tuple[int, int, int]]] = []
    for d, size in enumerate(global_shape):
        if d in dim_index:
            per_dim.append(_runs(dim_index[d]))
        else:
            per_dim.append([(0, 0, size)])
    pieces = []
    for combo in itertools.product(*per_dim):
        offsets = tuple(r[0] for r in combo)
        shape = tuple(r[2] for r in combo)
        view = local
        for d, (_, lstart, length) in enumerate(combo):
            if lstart != 0 or length != view.shape[d]:
                view = view.narrow(d, lstart, length)
        pieces.append(Piece(offsets, shape, view))
    if not global_shape:
        pieces = [Piece((), (), local)]
    return pieces


def dtensor_layout(dt: torch.Tensor) -> LocalLayout:
    """The pieces of a DTensor's local shard. Partial placements must be reduced first."""
    mesh = dt.device_mesh  # type: ignore[attr-defined]
    placements = dt.placements  # type: ignore[attr-defined]
    global_shape = tuple(dt.shape)
    local = dt.to_local()  # type: ignore[attr-defined]
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh
        return LocalLayout(global_shape, dt.dtype, [], 1, 0, False)
    local_size = list(global_shape)
    dim_index: dict[int, torch.Tensor] = {}
    replicas, replica_index = 1, 0
    for mesh_dim, p in enumerate(placements):
        if tc.is_shard_placement(p):
            d = p.dim
            size, index = tc.shard_dim_indices(local_size[d], mesh.size(mesh_dim), coord[mesh_dim], p, dim_index.get(d))
            local_size[d] = size
            dim_index[d] = index
        elif tc.is_partial(p):
            raise ValueError("DTensor with Partial placement must be reduced before saving")
        else:  # Replicate
            replica_index = replica_index * mesh.size(mesh_dim) + coord[mesh_dim]
            replicas *= mesh.size(mesh_dim)
    if tuple(local.shape) != tuple(local_size):
        # Uneven FSDP2 shards may carry padding in the local tensor; keep the logical part.
        for d, s in enumerate(local_size):
            local = local.narrow(d, 0, s)
    if any(s == 0 for s in local_size):
        pieces: list[Piece] = []
    else:
        pieces = _pieces_from_dim_indices(local, global_shape, dim_index)
    return LocalLayout(global_shape, dt.dtype, pieces, replicas, replica_index, False)


def sharded_tensor_layout(st: torch.Tensor) -> LocalLayout:
    """The local shards of a ShardedTensor (FSDP1 sharded state dicts)."""
    global_shape = tuple(st.size())
    pieces = []
    for shard in st.local_shards():  # type: ignore[attr-defined]
        md = shard.metadata
        shape = tuple(int(s) for s in md.shard_sizes)
        if math.prod(shape) == 0:
            continue
        pieces.append(Piece(tuple(int(o) for o in md.shard_offsets), shape, shard.tensor))
    dtype = st.dtype if hasattr(st, "dtype") else st.local_shards()[0].tensor.dtype  # type: ignore[attr-defined]
    return LocalLayout(global_shape, dtype, pieces, 1, 0, False)


def plain_layout(t: torch.Tensor, world_size: int, rank: int) -> LocalLayout:
    """A plain tensor: the whole global tensor, replicated on every rank (DDP semantics)."""
    shape = tuple(t.shape)
    return LocalLayout(shape, t.dtype, [Piece((0,) * len(shape), shape, t)], world_size, rank, True)


def fragment_layout(f: Fragment) -> LocalLayout:
    """A flat range of a tensor (a ZeRO partition): its boxes, owned by this rank alone."""
    pieces = [Piece(offsets, shape, view) for offsets, shape, view in f.views()]
    return LocalLayout(f.global_shape, f.dtype, pieces, 1, 0, False)


def layout_of(value: torch.Tensor | Fragment, world_size: int, rank: int) -> LocalLayout:
    if isinstance(value, Fragment):
        return fragment_layout(value)
    if tc.is_dtensor(value):
        return dtensor_layout(value)
    if tc.is_sharded_tensor(value):
        return sharded_tensor_layout(value)
    return plain_layout(value, world_size, rank)


def replica_writer(key: str, replicas: int) -> int:
    """Which replica writes a replicated DTensor piece: spread over replicas by key."""
    return zlib.crc32(key.encode()) % replicas if replicas > 1 else 0


def balance_plain(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Assign replicated plain tensors to writer ranks, largest first onto the least loaded.

    Every rank computes the same answer from the same keys and sizes, so no communication
    is needed; the coordinator's tiling check catches a rank that disagrees.
    """
    if world_size == 1:
        return dict.fromkeys(sizes, 0)
    heap = [(0, r) for r in range(world_size)]  # (load, rank): the least loaded, lowest rank first
    out = {}
    for neg, key in sorted([(-n, k) for k, n in sizes.items()]):
        load, r = heap[0]
        out[key] = r
        heapq.heapreplace(heap, (load + max(-neg, 1), r))
    return out


__all__ = [
    "LocalLayout",
    "Piece",
    "balance_plain",
    "contiguous_strides",
    "dtensor_layout",
    "fragment_layout",
    "layout_of",
    "plain_layout",
    "replica_writer",
    "sharded_tensor_layout",
]
