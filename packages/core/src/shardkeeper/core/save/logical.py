"""Logical digests, the save's side (state/logical.py has those of tensors): each rank's sums
over the pieces it writes, per leaf, computed in the background from the staged bytes while
its files are written (the block digests' part of the save), for the coordinator to combine
into the manifest's ``logical`` member (format/logical_member.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from shardkeeper.core.commit.protocol import RankReport
from shardkeeper.core.format import logical
from shardkeeper.core.format.logical_member import add_sums, decode_sums, encode_sums
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.save.stage import Span

#: Whether saves record logical digests (a switch for benchmarks that measure their cost).
ENABLED = True


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
    "split_sums",
    "submit_sums",
    "with_group_sums",
    "with_logical",
]
