"""Staging: the part of a save that blocks training, copying what a rank writes to host memory.

The copy lands in one host buffer that is reused across saves, so that the background writer
can send it to storage while training goes on changing the live tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from shardkeeper.core.tensor.chunks import contiguous_strides

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from shardkeeper.core.tensor.save import WriteItem

_ALIGN = 64

#: Where an item's bytes are for the writer: (buffer, start, end).
Span = tuple[memoryview, int, int]


class Stager:
    """Copies write items into one reusable host buffer (pinned when the sources are on CUDA).

    The buffer is allocated once and reused while the state's size does not grow, so steady
    state saves allocate nothing. Staging is the only part of a save that blocks training.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.last_stage_s = 0.0

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, groups: Sequence[Sequence[WriteItem]], *, copy: bool = True) -> list[list[Span]]:
        """Where each item's bytes are for the writer: one span per item, per group.

        ``copy=True`` (async saves): every item is copied into the buffer, the items of a
        group back to back in file order, so the group's spans are adjacent slices of one
        region, byte for byte the data section of its shard file, and the writer sends them
        in a few large writes straight from the buffer.

        ``copy=False`` (synchronous saves, where the caller waits for the commit and cannot
        change its tensors meanwhile): items held contiguously in CPU memory are written
        from their own memory with no copy at all; only the others are staged.
        """
        t0 = time.perf_counter()
        direct: dict[int, Span] = {}
        if not copy:
            for g in groups:
                for it in g:
                    src = it.src
                    if src.device.type == "cpu" and src.is_contiguous():
                        view = memoryview(cast("Buffer", src.detach().reshape(-1).view(torch.uint8).numpy()))
                        direct[id(it)] = (view, 0, it.nbytes)
        starts = []
        pos = 0
        any_cuda = False
        for g in groups:
            starts.append(pos)
            pos += -(-sum(it.nbytes for it in g if id(it) not in direct) // _ALIGN) * _ALIGN
            any_cuda = any_cuda or any(it.src.is_cuda for it in g)
        spans: list[list[Span]] = []
        if pos == 0:
            spans = [[direct[id(it)] for it in g] for g in groups]
            self.last_stage_s = time.perf_counter() - t0
            return spans
        buf = self._buffer
        pinned = any_cuda and torch.cuda.is_available()
        if buf is None or buf.numel() < pos or (pinned and not buf.is_pinned()):
            self._buffer = None  # release before allocating the larger one
            buf = torch.empty(pos, dtype=torch.uint8, pin_memory=pinned)
            self._buffer = buf
        whole_bytes = memoryview(cast("Buffer", buf.numpy()))
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        typed: dict[torch.dtype, torch.Tensor] = {}
        for g, start in zip(groups, starts):
            off = start
            group_spans: list[Span] = []
            for it in g:
                span = direct.get(id(it))
                if span is not None:
                    group_spans.append(span)
                    continue
                dtype = it.src.dtype
                whole = typed.get(dtype)
                if whole is None:
                    size = torch.empty((), dtype=dtype).element_size()
                    whole = typed[dtype] = buf[: buf.numel() - buf.numel() % size].view(dtype)
                # Widest dtypes first (see _file_order) keeps every offset a multiple of the
                # item size, so the bytes can be viewed as the dtype: one view per item.
                dsts.append(whole.as_strided(it.shape, contiguous_strides(it.shape), off // whole.element_size()))
                srcs.append(it.src)
                group_spans.append((whole_bytes, off, off + it.nbytes))
                off += it.nbytes
            spans.append(group_spans)
        if dsts:
            # One call for all copies: per-tensor Python overhead matters with many small tensors.
            torch._foreach_copy_(dsts, srcs, non_blocking=any_cuda)
        if any_cuda:
            torch.cuda.synchronize()
        self.last_stage_s = time.perf_counter() - t0
        return spans
