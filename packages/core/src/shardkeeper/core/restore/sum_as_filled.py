"""The restore's logical sums as the reads land, not after all of them: once the last read
writing into a tensor's memory is done, the tensor is summed by the check's own thread while
the I/O threads go on reading, so on storage slower than the sums the check costs almost
nothing. One thread, not the I/O threads themselves: sums running in several threads beside
torch's copies made each slower (the cores spent spinning, not summing).

What counts is memory, not keys: a tensor is summed once no planned read writes into bytes
it shares with it (another key that aliases it, a tied weight, a view into one flat buffer),
so a sum never sees a half-written value. The tensors whose memory overlaps, and the pieces
of one tensor, are summed together (``_components``); a tensor no read writes into is summed
after the reads (``LogicalCheck.sum_rest``), as is everything when a read failed.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from shardkeeper.core.restore.logical_check import LogicalCheck
from shardkeeper.core.restore.plan import Op
from shardkeeper.core.restore.reads import Read
from shardkeeper.core.restore.share import Job

#: A span of memory: (device, first byte address, end address).
Span = tuple[str, int, int]


def _span(t: torch.Tensor) -> Span | None:
    """The bytes ``t``'s elements lie within (its strides may leave gaps: the span covers
    them, which only makes more tensors wait for each other)."""
    if not t.numel():
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return str(t.device), lo, lo + extent * t.element_size()


def _ops(item: Any) -> Iterator[Op]:
    """The ops a job's item carries: one op, a coalesced read's segments, an encoded chunk's."""
    if isinstance(item, Op):
        yield item
    elif isinstance(item, Read):
        for seg in item.segments:
            yield from seg.ops
    else:
        yield from item


class SumsAsFilled:
    """Which jobs write into which checked tensors, and the sums that run as they finish."""

    def __init__(self, check: LogicalCheck, jobs: Sequence[Job], failed: threading.Event) -> None:
        self._check = check
        self._failed = failed
        self._lock = threading.Lock()
        self._ready: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        keys, self._blocks = _components(check)
        self._keys: list[list[str]] = keys
        self._remaining = [0] * len(keys)
        self._of_job: dict[int, tuple[int, ...]] = {}
        for job in jobs:
            touched = {c for op in _ops(job.item) for c in self._touching(op.dest)}
            self._of_job[id(job)] = tuple(touched)
            for c in touched:
                self._remaining[c] += 1
        self._thread = threading.Thread(target=self._sum_ready, name="shardkeeper-logical-sums", daemon=True)
        self._thread.start()

    def _sum_ready(self) -> None:
        """The check's thread: sums each group of tensors handed to it, until ``close``."""
        while (c := self._ready.get()) is not None:
            if self._failed.is_set() or self._errors:
                continue  # (the restore fails anyway: drain, sum nothing)
            try:
                for key in self._keys[c]:
                    self._check.sum(key)
            except BaseException as e:  # raised by close(), on the restoring thread
                self._errors.append(e)

    def close(self) -> None:
        """Once every job has run: wait for the sums handed over, and raise a failure of one."""
        self._ready.put(None)
        self._thread.join()
        if self._errors:
            raise self._errors[0]

    def _touching(self, dest: torch.Tensor) -> Iterable[int]:
        """The components whose memory ``dest`` overlaps."""
        span = _span(dest)
        if span is None:
            return ()
        dev, lo, hi = span
        starts, ends, comps = self._blocks.get(dev, ((), (), ()))
        i = bisect.bisect_left(starts, hi) - 1  # blocks are disjoint and sorted: walk back
        out = []
        while i >= 0 and ends[i] > lo:
            out.append(comps[i])
            i -= 1
        return out

    def wrap(self, job: Job) -> Callable[..., None]:
        """``job.fn``, then the tensors it was the last to write into handed to the check's
        thread."""

        def run(*args: Any) -> None:
            job.fn(*args)
            with self._lock:
                for c in self._of_job.get(id(job), ()):
                    self._remaining[c] -= 1
                    if self._remaining[c] == 0:
                        self._ready.put(c)

        return run


def _components(check: LogicalCheck) -> tuple[list[list[str]], dict[str, tuple[list[int], list[int], list[int]]]]:
    """The checked tensors grouped so that a group's memory overlaps no other group's: its
    keys, and per device the sorted disjoint blocks of memory with their group's index."""
    spans: list[tuple[str, int, int, int]] = []  # (device, lo, hi, key index)
    names = list(check.tasks)
    for k, key in enumerate(names):
        for p in check.tasks[key].pieces:
            s = _span(p.local)
            if s is not None:
                spans.append((*s, k))
    parent = list(range(len(names)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    merged: list[tuple[str, int, int, int]] = []  # (device, lo, hi, a key in the block)
    for dev, lo, hi, k in sorted(spans):
        if merged and merged[-1][0] == dev and lo < merged[-1][2]:
            d, mlo, mhi, mk = merged[-1]
            parent[find(k)] = find(mk)
            merged[-1] = (d, mlo, max(mhi, hi), mk)
        else:
            merged.append((dev, lo, hi, k))
    groups: dict[int, int] = {}
    keys: list[list[str]] = []
    for k, key in enumerate(names):
        root = find(k)
        if root not in groups:
            groups[root] = len(keys)
            keys.append([])
        keys[groups[root]].append(key)
    blocks: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for dev, lo, hi, k in merged:
        starts, ends, comps = blocks.setdefault(dev, ([], [], []))
        starts.append(lo)
        ends.append(hi)
        comps.append(groups[find(k)])
    return keys, blocks


__all__ = ["SumsAsFilled"]
