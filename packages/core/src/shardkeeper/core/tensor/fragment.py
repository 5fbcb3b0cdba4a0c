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

#: A box of the global tensor (offsets, shape) and where its elements start in the fragment.
FlatBox = tuple[tuple[int, ...], tuple[int, ...], int]


class Fragment:
    """Elements ``[offset, offset + local.numel())`` of a row-major tensor of ``global_shape``.

    ``local`` must be a 1-D tensor with unit stride (a slice of a flat buffer); save reads it,
    restore writes into it. On every rank together, the fragments of one key must cover the
    global tensor exactly once (the commit checks it).
    """

    __slots__ = ("global_shape", "local", "offset")

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], offset: int) -> None:
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
        self.local = local
        self.global_shape = shape
        self.offset = int(offset)

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
            f"numel={self.numel}, dtype={self.dtype})"
        )


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[FlatBox]:
    """Split flat elements ``[start, end)`` of a row-major ``shape`` into boxes, in order."""
    shape = tuple(shape)
    out: list[FlatBox] = []
    _split(shape, start, end, (), 0, out)
    return out


def _split(
    shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], base: int, out: list[FlatBox]
) -> None:
    if start >= end:
        return
    lead = (1,) * len(prefix)
    if not shape:  # a 0-d tensor: one element
        out.append((prefix, lead, base))
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    if inner == 0:
        return
    first_full = -(-start // inner)  # the first row that starts at or after `start`
    last_full = end // inner  # rows [first_full, last_full) are whole
    if first_full > last_full:  # the range lies inside one row
        row = start // inner
        _split(rest, start - row * inner, end - row * inner, (*prefix, row), base, out)
        return
    if start < first_full * inner:  # a partial leading row
        row = start // inner
        _split(rest, start - row * inner, inner, (*prefix, row), base, out)
    if last_full > first_full:
        zeros = (0,) * len(rest)
        out.append(
            ((*prefix, first_full, *zeros), (*lead, last_full - first_full, *rest), base + first_full * inner - start)
        )
    if end > last_full * inner:  # a partial trailing row
        _split(rest, 0, end - last_full * inner, (*prefix, last_full), base + last_full * inner - start, out)


__all__ = ["FlatBox", "Fragment", "flat_range_boxes"]
