"""Logical digests of torch tensors (format/logical.py has the definition): of a whole tensor
(``logical_digest``), of a shard (``logical_partial``, any box of the global tensor, or what
a DTensor, ShardedTensor or ZeRO fragment holds on this rank), of partials together
(``logical_combine``), and of the pieces a rank holds (``piece_sums``: the save's replica
check and the restore's check of what it assembled).

CPU tensors are digested in host memory (numpy); a CUDA tensor on its device, by torch ops
(state/logical_torch.py), never copied to the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core.format import logical
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import LocalLayout, Piece, layout_of
from shardkeeper.core.state.copies import copy_of
from shardkeeper.core.state.flatten import torch_dtype_name
from shardkeeper.core.state.fragment import Fragment
from shardkeeper.core.state.logical_torch import device_partials
from shardkeeper.core.util.ints import integral


@dataclass(frozen=True)
class LogicalPartial:
    """A shard's share of a tensor's logical digest: the tensor's dtype and global shape,
    and the sum (mod 2^64) over the elements the shard holds. Partials of shards that tile
    the tensor, each element once, ``logical_combine`` into its ``logical_digest``."""

    dtype: str
    shape: tuple[int, ...]
    value: int

    def __add__(self, other: LogicalPartial) -> LogicalPartial:
        if (self.dtype, self.shape) != (other.dtype, other.shape):
            raise ValueError(
                f"partials of different tensors: {self.dtype} {list(self.shape)} and {other.dtype} {list(other.shape)}"
            )
        return LogicalPartial(self.dtype, self.shape, (self.value + other.value) & logical.MASK)


def _dense(t: torch.Tensor, what: str) -> None:
    """TypeError unless ``t`` is a dense tensor holding its elements (not nested, meta or sparse)."""
    if t.is_nested:
        raise TypeError(
            f"{what}: a nested tensor (components of different shapes) has no row-major elements to digest; "
            f"digest each component of its unbind()"
        )
    if t.device.type == "meta":
        raise TypeError(
            f"{what}: a meta tensor (shape {list(t.shape)}, {t.dtype}) holds no elements to digest; "
            f"materialize it first (e.g. to_empty() and load its weights)"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"{what}: a {str(t.layout).removeprefix('torch.')} tensor has no row-major elements to digest; "
            f"pass its to_dense() (a checkpoint stores sparse tensors as dense leaves, if at all)"
        )


def _dtype(t: torch.Tensor) -> tuple[str, int]:
    name = torch_dtype_name(t.dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype {name} has no logical digest: the format stores only {', '.join(DTYPES)}")
    return name, DTYPES[name][1]


def host_bytes(t: torch.Tensor) -> memoryview:
    """``t``'s elements in row-major order, little-endian, as bytes in host memory."""
    flat = t.detach().to("cpu").resolve_neg().resolve_conj().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _box_sum(local: torch.Tensor, shape: Sequence[int], offsets: Sequence[int]) -> int:
    _, size = _dtype(local)
    if local.device.type != "cpu":  # summed where it lives (state/logical_torch.py)
        return device_partials([(local, shape, offsets)])[0]
    return logical.box_sum(host_bytes(local), size, shape, offsets, tuple(local.shape))


def logical_digest(tensor: torch.Tensor) -> str:
    """The logical digest of a whole tensor (docs/format.md, "Logical digests"): 16 hex
    digits, equal to the ``logical`` digest a checkpoint records for a leaf holding the same
    dtype, shape and elements, however it was sharded when saved. A DTensor or ShardedTensor
    is refused: ``logical_combine`` every rank's ``logical_partial``, or pass ``full_tensor()``;
    so is a nested, meta or sparse tensor (TypeError: no row-major elements to digest)."""
    if not isinstance(tensor, torch.Tensor) or tc.is_dtensor(tensor) or tc.is_sharded_tensor(tensor):
        raise TypeError(
            f"logical_digest takes a whole torch.Tensor, not a {type(tensor).__name__}: for a distributed "
            f"tensor, logical_combine() every rank's logical_partial(), or pass its full_tensor()"
        )
    _dense(tensor, "logical_digest")
    name, _ = _dtype(tensor)
    shape = tuple(tensor.shape)
    return logical.finalize(name, shape, _box_sum(tensor, shape, (0,) * len(shape)))


def logical_partial(
    shard: torch.Tensor | Fragment,
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
) -> LogicalPartial:
    """This shard's partial of its tensor's logical digest. A plain tensor is the box at
    ``offsets`` of a tensor of ``global_shape`` (both required). A DTensor, ShardedTensor or
    ``Fragment`` (no offsets) gives the pieces this rank holds; of replicated pieces
    (``Replicate`` mesh dimensions, and the copies on the other submeshes of a DTensor on a
    submesh), only copy 0's count, so every rank's partials, combined, give the whole
    tensor's digest."""
    if isinstance(shard, Fragment) or tc.is_dtensor(shard) or tc.is_sharded_tensor(shard):
        if offsets is not None or global_shape is not None:
            raise TypeError("offsets and global_shape are for plain tensors: a distributed tensor knows its own")
        layout = layout_of(shard, 1, 0)
        name = torch_dtype_name(layout.dtype)
        if name not in DTYPES:
            raise TypeError(f"dtype {name} has no logical digest: the format stores only {', '.join(DTYPES)}")
        shape = tuple(layout.global_shape)
        total = 0
        if _first_copy(shard, layout):
            total = sum(_box_sum(p.local, shape, p.offsets) for p in layout.pieces)
        return LogicalPartial(name, shape, total & logical.MASK)
    if offsets is None or global_shape is None:
        raise TypeError(
            "logical_partial(shard, offsets, global_shape): a plain tensor's place in its tensor is required"
        )
    _dense(shard, "logical_partial")
    name, _ = _dtype(shard)
    shape = _place("global_shape", global_shape, shard.dim())
    return LogicalPartial(name, shape, _box_sum(shard, shape, _place("offsets", offsets, shard.dim())))


def _place(what: str, values: Any, dims: int) -> tuple[int, ...]:
    """``values`` (a plain shard's ``offsets`` or ``global_shape``) as ints, one per dimension
    of the ``dims``-d shard: TypeError for a value that is not integral (a float or a bool,
    which ``int()`` would truncate into another box), ValueError for another count."""
    try:
        items = list(values)
    except TypeError:
        raise TypeError(
            f"logical_partial: {what} must be a sequence of ints, one per dimension, not a {type(values).__name__}"
        ) from None
    out = []
    for v in items:
        n = integral(v)
        if n is None:
            shown = f"{type(v).__name__} {v!r}" if isinstance(v, (bool, int, float, str)) else type(v).__name__
            raise TypeError(f"logical_partial: {what} must hold ints, got {shown}")
        out.append(n)
    if len(out) != dims:
        raise ValueError(
            f"logical_partial: {what} {out} has {len(out)} dimension(s), for a {dims}-d shard: give one per dimension"
        )
    return tuple(out)


def _first_copy(t: torch.Tensor | Fragment, layout: LocalLayout) -> bool:
    """Whether this rank's pieces are the copy whose partial counts: copy 0 over the world
    (state/copies.py: a DTensor on a submesh has copies its mesh does not name)."""
    if tc.is_dtensor(t):
        world = dist.get_world_size() if dist.is_initialized() else t.device_mesh.size()
        copy = copy_of(t, layout, world)
        if copy is not None:
            return copy.index == 0
    return layout.replica_index == 0


def logical_combine(partials: Iterable[LogicalPartial]) -> str:
    """The logical digest of the tensor whose shards gave ``partials`` (in any order; each
    element held by exactly one of them)."""
    if isinstance(partials, LogicalPartial):
        raise TypeError("logical_combine() takes an iterable of LogicalPartial: pass [partial] for one")
    parts = list(partials)
    for p in parts:
        if not isinstance(p, LogicalPartial):
            raise TypeError(
                f"logical_combine() takes LogicalPartial values (what logical_partial returns), got a {type(p).__name__}"
            )
    if not parts:
        raise ValueError("logical_combine() needs at least one partial (a tensor's dtype and shape come from them)")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return logical.finalize(total.dtype, total.shape, total.value)


def piece_sums(dtype: str, shape: Sequence[int], pieces: Sequence[Piece]) -> int:
    """The sum (mod 2^64) over ``pieces`` of a tensor of ``dtype`` and global ``shape``
    (the pieces of a ``LocalLayout``: disjoint boxes): those in host memory batched in one
    pass over their bytes (numpy: the faster on a CPU), those on a device summed there
    (state/logical_torch.py: no copy to the host)."""
    size = DTYPES[dtype][1]
    held = [p for p in pieces if p.local.numel()]
    on_device = [(p.local, shape, p.offsets) for p in held if p.local.device.type != "cpu"]
    boxes = [
        (host_bytes(p.local), size, logical.Box(shape, p.offsets, p.shape))
        for p in held
        if p.local.device.type == "cpu"
    ]
    return logical.combine_sums([*logical.box_sums(boxes), *(device_partials(on_device) if on_device else [])])


__all__ = ["LogicalPartial", "host_bytes", "logical_combine", "logical_digest", "logical_partial", "piece_sums"]
