"""Staging: copying what a rank writes to host memory, so training may change its tensors.

The copy lands in one host buffer that is reused across saves, so that the background writer
can send it to storage while training goes on changing the live tensors. With overlapped
staging (``save/overlap.py``) part of the copy is *deferred*: it runs in the background,
during the next forward and backward, and the next optimizer step waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.safetensors import PAGE_ALIGN, data_offsets, data_on_a_page
from shardkeeper.core.save.deferred import DeferredCopy
from shardkeeper.core.save.pinned import cuda_devices, host_buffer
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import contiguous_strides
from shardkeeper.core.state.flatten import FlatState

if TYPE_CHECKING:
    from typing_extensions import Buffer

_ALIGN = 64
#: Synchronous saves write items of at least this size straight from their own memory; smaller
#: ones are copied into the staging buffer first, so that they go out in a few large writes.
DIRECT_MIN_BYTES = 1 << 20


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def unreadable(key: str, t: torch.Tensor, where: str = "") -> StateMismatchError | None:
    """Why the bytes of ``t`` (state key ``key``) cannot be staged, or None: the format stores
    dense (strided) tensors with data, so a nested tensor (of either layout), a sparse or
    mkldnn layout, or a tensor on the meta device, is refused before anything is written,
    naming the remedy (and ``where``: the save's step and rank), as a dtype the format does
    not store is (``save/plan.py``)."""
    head = f"{where}: state key {key!r}" if where else f"state key {key!r}"
    if t.is_nested:
        return StateMismatchError(
            f"{head} is a nested tensor (components of different shapes), which the format does not store "
            f"(only dense, strided tensors); save its components instead: .unbind() gives a list of tensors, or "
            f"torch.nested.to_padded_tensor(t, 0.0) one padded tensor"
        )
    if t.layout is not torch.strided:
        layout = str(t.layout).removeprefix("torch.").lstrip("_")
        return StateMismatchError(
            f"{head} is a tensor of layout {layout}, which the format does not store (only dense, strided "
            f"tensors); convert it first: .to_dense()"
        )
    if t.device.type == "meta":
        return StateMismatchError(
            f"{head} is a tensor on the meta device, which holds no data to save; materialise it "
            f"first (e.g. module.to_empty(device='cpu') then initialise or load its values)"
        )
    return None


def raise_refused(flat: FlatState, where: str, cause: BaseException | None = None) -> None:
    """Raise ``unreadable``'s refusal of the first tensor leaf of ``flat`` that cannot be
    staged, naming ``where`` (not caused by torch's error); else, when ``cause`` is the
    planner's own refusal (a ``StateMismatchError``: a dtype the format does not store), that
    refusal naming ``where``; return when neither. A DTensor or ShardedTensor (a wrapper of
    local tensors, which the copy checks) is passed over. For a save whose plan or copy
    failed: checking every leaf up front would cost every save."""
    for key, leaf in flat.leaves.items():
        t = leaf.value
        if leaf.kind != "tensor" or not isinstance(t, torch.Tensor) or tc.is_dtensor(t) or tc.is_sharded_tensor(t):
            continue
        err = unreadable(key, t, where)
        if err is not None:
            raise err from None
    if type(cause) is StateMismatchError and not str(cause).startswith(where):
        raise StateMismatchError(f"{where}: {cause}") from None


def _check_readable(items: Sequence[WriteItem], srcs: Sequence[torch.Tensor]) -> None:
    """Raise ``unreadable``'s error for the first such source (after a failed copy: checking
    every source up front would cost a fifth of a many-small-tensors stall)."""
    for it, src in zip(items, srcs):
        err = unreadable(it.key, src)
        if err is not None:
            raise err


#: Where an item's bytes are for the writer: (buffer, start, end).
Span = tuple[memoryview, int, int]
#: How a ``Stager`` gets its buffer: (nbytes, CUDA device or None) -> (uint8 tensor, how pinned).
Allocate = Callable[[int, "int | None"], "tuple[torch.Tensor, str | None]"]


class Stager:
    """Copies write items into one reusable host buffer (pinned when the sources are on CUDA).

    The buffer is allocated once and reused while the state's size does not grow, so steady
    state saves allocate nothing. Staging is the only part of a save that blocks training.
    A pinned buffer is pinned at its exact size (``save/pinned.py``); ``pinned_how`` says
    how (``"registered"``, ``"allocator"``), None while the buffer is not pinned.
    """

    def __init__(self, allocate: Allocate = host_buffer) -> None:
        """``allocate(nbytes, cuda device or None)``: the buffer and how it is pinned
        (``save/pinned.py``; a persist process's writer passes shared memory, ``save/shared.py``)."""
        self._allocate = allocate
        self._buffer: torch.Tensor | None = None  # a page-aligned view of _raw
        self._raw: torch.Tensor | None = None
        self._layouts: dict[Any, _Layout] = {}  # by (plan token, direct items): stage_split
        self._last: _Layout | None = None  # the layout whose items the buffer holds now
        self.pinned_how: str | None = None
        self.last_stage_s = 0.0

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def allocation(self) -> tuple[torch.Tensor, int] | None:
        """The buffer as allocated (``allocate``'s tensor) and the offset in it where the
        spans' offsets count from; None before the first staged item."""
        if self._buffer is None or self._raw is None:
            return None
        return self._raw, self._buffer.data_ptr() - self._raw.data_ptr()

    def stage(self, groups: Sequence[Sequence[WriteItem]], *, copy: bool = True) -> list[list[Span]]:
        """Where each item's bytes are for the writer, everything copied now (see ``stage_split``)."""
        spans, _ = self.stage_split(groups, copy=copy)
        return spans

    def stage_split(
        self,
        groups: Sequence[Sequence[WriteItem]],
        *,
        copy: bool = True,
        defer: Callable[[torch.Tensor], Sequence[torch.Tensor] | None] | None = None,
        token: object | None = None,
        sources: list[torch.Tensor] | None = None,
    ) -> tuple[list[list[Span]], DeferredCopy | None]:
        """Where each item's bytes are for the writer: one span per item, per group.

        ``copy=True`` (async saves): every item is copied into the buffer, the items of a
        group back to back in file order, so the group's spans are adjacent slices of one
        region, byte for byte the data section of its shard file, and the writer sends them
        in a few large writes straight from the buffer.

        ``copy=False`` (synchronous saves, where the caller waits for the commit and cannot
        change its tensors meanwhile): items of at least ``DIRECT_MIN_BYTES`` held
        contiguously in CPU memory are written from their own memory with no copy at all;
        the others are staged (a write per small item costs more than its copy).

        ``defer`` (overlapped staging): an item for which it returns tensors (the ones whose
        in-place changes must not race the copy: the source, and the parameter or state
        tensor it belongs to) gets its place in the buffer, but its copy is returned as a
        ``DeferredCopy`` for the caller to run later; every other item (``None``) is copied
        before this returns. The spans are valid once the deferred copy has run.

        ``token`` (``SavePlan.token``): the same token means the same items in the same
        groups, so the buffer layout (each item's place and typed view) of the last save
        with it is reused instead of rebuilt. ``sources`` (``SavePlan.sources``): the items'
        tensors in group order, for items that do not hold them (a cached plan's).
        """
        items = [it for g in groups for it in g]
        srcs_all = sources if sources is not None else [it.src for it in items]
        t0 = time.perf_counter()
        direct = {} if copy else _direct_items(items, srcs_all)  # flat item index -> the item's own bytes
        lay = self._layout_for(groups, srcs_all, direct, token)
        spans = _spans(lay, direct)
        if not lay.staged:
            self.last_stage_s = time.perf_counter() - t0
            return spans, None
        dsts, srcs, later = _split_deferred(lay, items, srcs_all, defer)
        last, self._last = self._last, None  # until this copy succeeds, the buffer is nobody's
        with torch.no_grad():  # sources may be parameters: the buffer must not join their graph
            if lay.pads and lay is not last:  # still zero since this layout's last save
                tc.zero_all(lay.pads)
            if dsts:
                # One call for all copies: per-tensor Python overhead matters with many small tensors.
                try:
                    tc.copy_all(dsts, srcs, non_blocking=bool(lay.cuda))
                except (RuntimeError, NotImplementedError):
                    # (Never deferred: a meta or storage-less tensor has no storage for
                    # save/overlap.py to match, so its copy fails here, on the caller's thread.)
                    _check_readable(items, srcs_all)
                    raise
            if dsts and lay.cuda:
                _wait_for_copies(lay.cuda)
        self._last = lay
        self.last_stage_s = time.perf_counter() - t0
        return spans, (later if later.items else None)

    def _layout_for(
        self, groups: Sequence[Sequence[WriteItem]], srcs: Sequence[torch.Tensor], direct: dict[int, Span], token: Any
    ) -> _Layout:
        """The layout of the last save with ``token`` and the same direct items, while the
        buffer it points into is still the buffer; else a new one (kept for a few keys)."""
        key = (token, tuple(direct)) if token is not None else None
        lay = self._layouts.get(key) if key is not None else None
        if lay is None or (lay.buffer is not None and lay.buffer is not self._buffer):
            lay = self._lay_out(groups, srcs, direct, key)
            if key is not None:
                if len(self._layouts) >= 4:  # a few (e.g. a synchronous and an async one)
                    self._layouts.clear()
                self._layouts[key] = lay
        return lay

    def _lay_out(
        self, groups: Sequence[Sequence[WriteItem]], srcs: Sequence[torch.Tensor], direct: dict[int, Span], key: Any
    ) -> _Layout:
        """Place every staged item in the buffer (growing it if needed) and make its view."""
        starts = []
        placed: list[list[int]] = []  # per group: each staged item's offset from the group start
        pos = 0
        j = 0
        for g in groups:
            sizes = []
            for it in g:
                if j not in direct:
                    sizes.append(it.nbytes)
                j += 1
            # The shard file's data section, byte for byte when every item is staged.
            rel, n = data_offsets(sizes, align_items=True)
            pos = _round_up(pos, PAGE_ALIGN if data_on_a_page(n) else _ALIGN)
            starts.append(pos)
            placed.append(rel)
            pos += n
        pos = _round_up(pos, _ALIGN)
        cuda = cuda_devices(srcs)
        if pos == 0:
            return _Layout(key, None, [None] * j, [[None] * len(g) for g in groups], [], [], cuda, [])
        buf = self._buffer
        if buf is None or buf.numel() < pos or (cuda and self.pinned_how is None):
            self._buffer = self._raw = self._last = None  # release before allocating the larger one
            self._layouts.clear()
            # The buffer, and each group that data_on_a_page says is page-aligned, start on a
            # page; so does such a file's data (format/safetensors.py): the bytes in the buffer
            # and in the file are congruent modulo the page size, and local storage writes them
            # with O_DIRECT.
            raw, self.pinned_how = self._allocate(pos + PAGE_ALIGN, cuda[0] if cuda else None)
            shift = -raw.data_ptr() % PAGE_ALIGN
            buf = raw[shift : shift + pos]
            self._buffer, self._raw = buf, raw
        whole_bytes = memoryview(cast("Buffer", buf.numpy()))
        typed: dict[torch.dtype, torch.Tensor] = {}
        dsts: list[torch.Tensor | None] = []
        spans: list[list[Span | None]] = []
        staged: list[int] = []
        pads: list[torch.Tensor] = []
        j = 0
        for g, start, rel in zip(groups, starts, placed):
            end = start
            at = iter(rel)
            group_spans: list[Span | None] = []
            for it in g:
                if j in direct:
                    dsts.append(None)
                    group_spans.append(None)
                    j += 1
                    continue
                off = start + next(at)
                if off > end:
                    pads.append(buf[end:off])
                dtype = srcs[j].dtype
                whole = typed.get(dtype)
                if whole is None:
                    size = torch.empty((), dtype=dtype).element_size()
                    whole = typed[dtype] = buf[: buf.numel() - buf.numel() % size].view(dtype)
                # Widest dtypes first (see _file_order) keeps every offset a multiple of the
                # item size, so the bytes can be viewed as the dtype: one view per item.
                dsts.append(
                    whole.as_strided(
                        it.shape, contiguous_strides(it.shape), whole.storage_offset() + off // whole.element_size()
                    )
                )
                staged.append(j)
                group_spans.append((whole_bytes, off, off + it.nbytes))
                end = off + it.nbytes
                j += 1
            spans.append(group_spans)
        staged_dsts = cast("list[torch.Tensor]", [dsts[k] for k in staged])
        return _Layout(key, buf, dsts, spans, staged, staged_dsts, cuda, pads)


def _direct_items(items: Sequence[WriteItem], srcs: Sequence[torch.Tensor]) -> dict[int, Span]:
    """A synchronous save's items written from their own memory, by flat index: those of at
    least ``DIRECT_MIN_BYTES`` held contiguously in CPU memory, each with its own bytes."""
    direct: dict[int, Span] = {}
    for j, it in enumerate(items):
        if it.nbytes >= DIRECT_MIN_BYTES:
            src = srcs[j]
            _check_readable((it,), (src,))  # before is_contiguous(), which a sparse tensor lacks
            if src.device.type == "cpu" and src.is_contiguous():
                view = memoryview(cast("Buffer", src.detach().reshape(-1).view(torch.uint8).numpy()))
                direct[j] = (view, 0, it.nbytes)
    return direct


def _spans(lay: _Layout, direct: dict[int, Span]) -> list[list[Span]]:
    """``lay``'s spans per group, each direct item's own bytes in its place."""
    if not direct:
        return lay.spans  # type: ignore[return-value]  # no direct item: no None in it
    spans: list[list[Span]] = []
    j = 0  # the flat index of the group's first item
    for placed in lay.spans:
        spans.append([direct[j + i] if sp is None else sp for i, sp in enumerate(placed)])
        j += len(placed)
    return spans


def _split_deferred(
    lay: _Layout,
    items: Sequence[WriteItem],
    srcs_all: list[torch.Tensor],
    defer: Callable[[torch.Tensor], Sequence[torch.Tensor] | None] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], DeferredCopy]:
    """The staged items' views and sources to copy now, and the copies ``defer`` puts off
    (those for which it returns the tensors to watch)."""
    later = DeferredCopy()
    if defer is None:
        if len(lay.staged) == len(items):
            return lay.staged_dsts, srcs_all, later
        return lay.staged_dsts, [srcs_all[j] for j in lay.staged], later
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for j in lay.staged:
        src = srcs_all[j]
        watch = defer(src)
        if watch is not None:
            later.add(items[j], src, lay.dsts[j], watch)  # type: ignore[arg-type]
        else:
            dsts.append(lay.dsts[j])  # type: ignore[arg-type]
            srcs.append(src)
    return dsts, srcs, later


def _wait_for_copies(devices: Sequence[int]) -> None:
    """Block until the copies just queued on each device's current stream have landed: an
    event on that stream, not a device-wide synchronize, which would also wait for every other
    stream's work (collectives, prefetches) and, when every copy was deferred, for nothing."""
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


@dataclass
class _Layout:
    """Where each item of one plan goes in the buffer (``Stager.stage_split``)."""

    key: Any
    buffer: torch.Tensor | None
    dsts: list[torch.Tensor | None]  # per item (groups flattened); None: written from its own memory
    spans: list[list[Span | None]]  # per group, per item; None where written from its own memory
    staged: list[int]  # the items copied into the buffer, as flat indices
    staged_dsts: list[torch.Tensor]  # their views, in that order
    cuda: tuple[int, ...]  # the CUDA devices the sources are on
    #: the alignment gaps between staged items (format/safetensors.py ITEM_ALIGN): zeroed
    #: unless this layout was also the last to fill the buffer (another layout, e.g. a
    #: synchronous save's of the same plan, may have written there)
    pads: list[torch.Tensor]


__all__ = ["DIRECT_MIN_BYTES", "Span", "Stager", "raise_refused", "unreadable"]
