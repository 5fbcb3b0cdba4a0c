"""Logical digests of torch tensors (format/logical.py has the definition): of a whole tensor
(``logical_digest``), of a shard (``logical_partial``, any box of the global tensor, or what
a DTensor, ShardedTensor or ZeRO fragment holds on this rank) and of partials together
(``logical_combine``); and the save's side: each rank's sums over the pieces it writes, per leaf,
computed in the background while its files are written (the block digests' part of the
save), for the coordinator to combine into the manifest's ``logical`` member
(format/logical_member.py).

CPU tensors are digested in host memory; a CUDA tensor is copied to the host first (a
digest computed on the device is to come).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from shardkeeper.core.commit.protocol import RankReport
from shardkeeper.core.format import logical
from shardkeeper.core.format.logical_member import add_sums, decode_sums, encode_sums
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.save.stage import Span
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import layout_of
from shardkeeper.core.state.flatten import torch_dtype_name
from shardkeeper.core.state.fragment import Fragment

#: Whether saves record logical digests (a switch for benchmarks that measure their cost).
ENABLED = True


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


def _dtype(t: torch.Tensor) -> tuple[str, int]:
    name = torch_dtype_name(t.dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype {name} has no logical digest: the format stores only {', '.join(DTYPES)}")
    return name, DTYPES[name][1]


def _host_bytes(t: torch.Tensor) -> memoryview:
    """``t``'s elements in row-major order, little-endian, as bytes in host memory."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _box_sum(local: torch.Tensor, shape: Sequence[int], offsets: Sequence[int]) -> int:
    _, size = _dtype(local)
    return logical.box_sum(_host_bytes(local), size, shape, offsets, tuple(local.shape))


def logical_digest(tensor: torch.Tensor) -> str:
    """The logical digest of a whole tensor (docs/format.md, "Logical digests"): 16 hex
    digits, equal to the ``logical`` digest a checkpoint records for a leaf holding the same
    dtype, shape and elements, however it was sharded when saved. A DTensor or ShardedTensor
    is refused: ``logical_combine`` every rank's ``logical_partial``, or pass ``full_tensor()``."""
    if not isinstance(tensor, torch.Tensor) or tc.is_dtensor(tensor) or tc.is_sharded_tensor(tensor):
        raise TypeError(
            f"logical_digest takes a whole torch.Tensor, not a {type(tensor).__name__}: for a distributed "
            f"tensor, logical_combine() every rank's logical_partial(), or pass its full_tensor()"
        )
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
    (``Replicate`` mesh dimensions), only replica 0's count, so every rank's partials,
    combined, give the whole tensor's digest."""
    if isinstance(shard, Fragment) or tc.is_dtensor(shard) or tc.is_sharded_tensor(shard):
        if offsets is not None or global_shape is not None:
            raise TypeError("offsets and global_shape are for plain tensors: a distributed tensor knows its own")
        layout = layout_of(shard, 1, 0)
        name = torch_dtype_name(layout.dtype)
        if name not in DTYPES:
            raise TypeError(f"dtype {name} has no logical digest: the format stores only {', '.join(DTYPES)}")
        shape = tuple(layout.global_shape)
        total = 0
        if layout.replica_index == 0:
            total = sum(_box_sum(p.local, shape, p.offsets) for p in layout.pieces)
        return LogicalPartial(name, shape, total & logical.MASK)
    if offsets is None or global_shape is None:
        raise TypeError(
            "logical_partial(shard, offsets, global_shape): a plain tensor's place in its tensor is required"
        )
    name, _ = _dtype(shard)
    shape = tuple(int(n) for n in global_shape)
    return LogicalPartial(name, shape, _box_sum(shard, shape, tuple(int(o) for o in offsets)))


def logical_combine(partials: Iterable[LogicalPartial]) -> str:
    """The logical digest of the tensor whose shards gave ``partials`` (in any order; each
    element held by exactly one of them)."""
    parts = list(partials)
    if not parts:
        raise ValueError("logical_combine() needs at least one partial (a tensor's dtype and shape come from them)")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return logical.finalize(total.dtype, total.shape, total.value)


# -- the save's side ---------------------------------------------------------------------------


def _group_sums(
    items: Sequence[WriteItem], spans: Sequence[Span], memo: dict[Any, Any] | None, index: int
) -> dict[str, int]:
    """Per key, the sum over the pieces of one file group (their staged bytes): short
    single runs (small tensors, a row shard of one) gathered from their buffer at once, the
    others box by box."""
    plan = memo.get(("logical", index)) if memo is not None else None
    if plan is None:  # the same for every save of a cached plan
        plan = [_piece(it) for it in items]
        if memo is not None:
            memo[("logical", index)] = plan
    sums = [0] * len(items)
    rest = []
    short: dict[tuple[int, bool], tuple[Any, list[int]]] = {}  # (buffer, wide) -> the buffer, its pieces
    for i, ((buf, a, b), (_, run)) in enumerate(zip(spans, plan)):
        if run is not None and not (run[0] and a % 2):
            short.setdefault((id(buf), run[0]), (buf, []))[1].append(i)
        elif b > a:
            rest.append(i)
    for (_, wide), (buf, idx) in short.items():
        got = logical.gathered_sums(
            buf, [spans[i][1] for i in idx], [plan[i][1][1] for i in idx], [plan[i][1][2] for i in idx], wide
        )
        for i, total in zip(idx, got):
            sums[i] = total
    got = logical.box_sums(
        [(spans[i][0][spans[i][1] : spans[i][2]], DTYPES[items[i].dtype][1], plan[i][0]) for i in rest]
    )
    for i, total in zip(rest, got):
        sums[i] = total
    out: dict[str, int] = {}
    for it, total in zip(items, sums):
        out[it.key] = (out.get(it.key, 0) + total) & logical.MASK
    return out


def _piece(it: WriteItem) -> tuple[logical.Box, tuple[bool, int, int] | None]:
    """An item's box and, for a short single run, ``(wide lanes, lanes, first lane)``."""
    box = logical.Box(it.global_shape, it.offsets, it.shape)
    size = DTYPES[it.dtype][1]
    per = 1 if size == 1 else size // 2
    lanes = box.numel * per
    return box, (size > 1, lanes, box.first * per) if box.count == 1 and 0 < lanes < logical.SHORT else None


_POOL: list[ThreadPoolExecutor] = []  # the process's summing thread, made on first use


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-logical"))
        return _POOL[0]


_POOL_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_POOL.clear)  # (a forked child has the pool's object, not its thread)


def submit_sums(
    groups: Sequence[Sequence[WriteItem]],
    spans: Sequence[Sequence[Span]],
    memo: dict[Any, Any] | None = None,
) -> list[Future[dict[str, int]]] | None:
    """Each file group's per-key sums, computed in the background while the writer's I/O
    threads write the files: on a thread of their own, one per process, so the writes keep
    every I/O thread and the sums take one core at most; None when ``ENABLED`` is off."""
    if not ENABLED:
        return None
    pool = _pool()
    return [pool.submit(_group_sums, g, s, memo, i) for i, (g, s) in enumerate(zip(groups, spans))]


def with_logical(chunks: dict[str, Any], futures: Sequence[Future[dict[str, int]]] | None) -> dict[str, Any]:
    """A rank's chunk report with its ``logical`` member: the sum of each of its keys, in
    the order of its ``keys`` (format/logical_member.py); as it was when none were computed."""
    if futures is None:
        return chunks
    sums: dict[str, int] = {}
    for f in futures:
        for key, s in f.result().items():
            sums[key] = (sums.get(key, 0) + s) & logical.MASK
    return {**chunks, "logical": encode_sums(sums.get(k, 0) for k in chunks["keys"])}


def split_sums(
    before: dict[str, Any], after: dict[str, Any], described: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rank's chunk report split from its described leaves (``index_write.split_report``:
    ``before`` and ``after``), its sums with it: those of the keys it still lists stay in it,
    those of the described keys (every one, sorted; 0 where it wrote none) become the
    ``logical`` member of its ``described`` report."""
    if "logical" not in before:
        return after, {}
    sums = dict(zip(before["keys"], decode_sums(before["logical"], len(before["keys"]))))
    kept = {**after, "logical": encode_sums(sums.get(k, 0) for k in after["keys"])}
    return kept, {"logical": encode_sums(sums.get(k, 0) for k in sorted(described))}


def with_group_sums(folded: RankReport, reports: Sequence[RankReport]) -> RankReport:
    """A group leader's folded report with its group's described sums added per key (the
    reports it folds lost theirs, so that equal ones stay equal; the other kinds it carries
    get zeros); unchanged when a rank of the group sent none."""
    texts = [(r.described or {}).get("logical") for r in reports]
    if not texts or any(not isinstance(t, str) for t in texts):
        return folded
    count = str(texts[0]).count(",") + 1
    zeros = encode_sums([0] * count)
    others = [replace(o, described={**o.described, "logical": zeros}) for o in folded.group.get("others", ())]
    group = {**folded.group, "others": others} if folded.group else folded.group
    return replace(folded, described={**folded.described, "logical": add_sums(texts, count)}, group=group)


__all__ = [
    "ENABLED",
    "LogicalPartial",
    "logical_combine",
    "logical_digest",
    "logical_partial",
    "split_sums",
    "submit_sums",
    "with_group_sums",
    "with_logical",
]
