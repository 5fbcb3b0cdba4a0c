"""``Fragment``: a contiguous range of a tensor's flattened elements, held by one rank.

ZeRO (DeepSpeed stages 1-3) and other flat-buffer optimizers partition a parameter by its
flattened elements, not by a dimension: rank ``r`` holds elements ``[offset, offset + n)`` of
the row-major flattened tensor. A flat range is not a box, but it is the union of at most
``2 * ndim - 1`` boxes (a partial first row, whole rows, a partial last row, recursively),
each a contiguous slice of the rank's 1-D buffer. The format stores boxes, so a fragment is
saved as those boxes and restored by filling the same slices in place: fragments written at
one partitioning restore into any other, and into DTensors or plain tensors, and back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardkeeper.core.format.grid import FlatBox, flat_range_boxes


class Fragment:
    """Elements ``[offset, offset + local.numel())`` of a row-major tensor of ``global_shape``.

    ``local`` must be a 1-D tensor with unit stride (a slice of a flat buffer); save reads it,
    restore writes into it. On every rank together, the fragments of one key must cover the
    global tensor exactly once (the commit checks it).

    ``partition`` (optional, ``(pos, part)``): the partitioning this fragment comes from, the
    same on every rank: the tensor's flattened elements lie at ``[pos, pos + numel)`` of a
    flat buffer of which rank ``r`` of the world holds elements ``[r * part, (r + 1) * part)``
    (ZeRO-1/2: a parameter's place in its group's buffer and the partition size; ZeRO-3:
    ``(0, partition size)``). A save can then record the key by that rule instead of a chunk
    per rank (``describe_layouts``, docs/format.md 3.8); this rank's fragment must be its part.
    """

    __slots__ = ("global_shape", "local", "offset", "partition")

    def __init__(
        self,
        local: torch.Tensor,
        global_shape: Sequence[int],
        offset: int,
        partition: tuple[int, int] | None = None,
    ) -> None:
        shape = tuple(int(s) for s in global_shape)
        if local.dim() != 1 or (local.numel() > 1 and local.stride(0) != 1):
            raise ValueError(
                f"Fragment needs a 1-D tensor with unit stride (a slice of a flat buffer); got "
                f"shape {list(local.shape)}, stride {list(local.stride())}"
            )
        total = math.prod(shape)
        if offset < 0 or offset + local.numel() > total:
            raise ValueError(
                f"Fragment [{offset}, {offset + local.numel()}) lies outside a tensor of shape "
                f"{list(shape)} ({total} elements)"
            )
        if partition is not None:
            pos, part = (int(v) for v in partition)
            if pos < 0 or part <= 0:
                raise ValueError(f"Fragment partition {tuple(partition)}: pos must be >= 0 and part > 0")
            partition = (pos, part)
        self.local = local
        self.global_shape = shape
        self.offset = int(offset)
        self.partition = partition

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def numel(self) -> int:
        return self.local.numel()

    def boxes(self) -> list[FlatBox]:
        """The boxes this fragment covers, in flat order, with each box's start in ``local``."""
        return flat_range_boxes(self.global_shape, self.offset, self.offset + self.numel)

    def views(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """Each box with the view of ``local`` that holds it (shaped like the box)."""
        out = []
        for offsets, shape, start in self.boxes():
            n = math.prod(shape)
            out.append((offsets, shape, self.local.narrow(0, start, n).view(shape)))
        return out

    def __repr__(self) -> str:
        return (
            f"Fragment(global_shape={list(self.global_shape)}, offset={self.offset}, "
            f"numel={self.numel}, dtype={self.dtype}"
            + (f", partition={self.partition}" if self.partition is not None else "")
            + ")"
        )


__all__ = ["FlatBox", "Fragment", "flat_range_boxes"]
