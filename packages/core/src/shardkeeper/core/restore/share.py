"""Replica-deduplicated restore reads: a byte range several ranks need is read from storage
once, by one of them, and sent to the others over a dedicated gloo process group.

Every rank plans its restore as usual (``restore/plan.py``); its fill jobs each read
one file range. The ranks exchange those ranges (``ReadShare.negotiate``, tensors only, no
pickle) and cut the ranges two or more ranks need into pieces, each owned by one of them (the
least loaded so far: reading spreads over the ranks). In rounds of a few percent of what a
rank restores (``bounds``), the owners read their pieces straight from storage, the ranks
agree which reads failed, and the owners send the rest to the ranks that need them (a
broadcast when all do, else gloo isend/irecv; bounded by the group's timeout); then each rank
runs the fill jobs of the round and drops the pieces no later job reads. Those read through
``SharedStorage``: a range held in the round's cache comes from it, anything else from the
storage. The chunk reader then checks every byte against the manifest's digests exactly as
if it had read it (``ChunkReader.check``), so a peer can never inject unverified bytes: a
damaged piece fails every rank that uses it, as a damaged file would. A piece whose owner
could not read it is read by each rank that needs it itself (a warning names the step, the
owner and the file), so that rank meets the storage's own error.

Every rank of the group calls ``negotiate`` once per attempt (with ``None`` when its attempt
failed before planning), and runs every round even after one of its own jobs failed: the
exchange never waits on a rank that left it.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import mmap
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from shardkeeper.core.errors import PeerExchangeError
from shardkeeper.core.restore.plan import RestoreStats
from shardkeeper.core.runtime.store_channel import gloo_group
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.storage.base import Storage

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

#: Pieces longer than this are split, so that large shared ranges are read by several owners.
PIECE_BYTES = 16 << 20
#: The pieces of one round, summed over the group: what one rank holds at once is at most this
#: (plus pieces kept for a job of a later round that also reads them) ...
ROUND_BYTES = 256 << 20
#: ... and at most this share of what the rank that restores least reads (``bounds``), so that
#: an exchange adds a few percent to a restore's memory, not the rounds' size: a rank that
#: restores a whole replicated model receives nearly all of it.
ROUND_SHARE = 1 / 32
#: Rounds are at least this large, whatever the share: each is a few collectives.
MIN_ROUND_BYTES = 8 << 20


@dataclass(slots=True)
class Job:
    """One fill call (``fn(reader, path, item, ...)``) and the file range [lo, hi) of ``path`` it reads."""

    fn: Callable[..., None]
    item: Any  # an op, a coalesced read, an encoded chunk's ops
    path: str
    lo: int
    hi: int


@dataclass(slots=True)
class Piece:
    fid: int
    lo: int
    hi: int
    needers: tuple[int, ...]  # group ranks
    owner: int
    round: int = 0
    path: str = ""  # known on the ranks that need it
    data: np.ndarray | None = None
    refs: int = 0  # this rank's jobs that read it and have not run


def _buffer(n: int) -> np.ndarray:
    """``n`` bytes (n >= 1) in a mapping of their own, unmapped as soon as the piece is dropped.
    From the heap, pieces freed may stay resident: glibc raises its mmap threshold to the size
    of a mapped block once freed, and then serves blocks of that size from arenas it trims
    only past twice that (measured: some 20 MiB more peak RSS in a replicated restore)."""
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _fid(path: str) -> int:
    """A file's id in the exchange: the same on every rank, no strings on the wire."""
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little", signed=True)


def _waited(work: Any, where: str) -> Any:
    try:
        return work.wait()
    except Exception as e:  # gloo's own error types: connection closed, timeout
        raise PeerExchangeError(
            f"{where} failed or timed out ({e}); a rank died or hangs. Restart the job and restore again, "
            f"or pass share_restore_reads=False to read every byte from storage"
        ) from e


class PeerGroup:
    """A gloo group of the coordinator's ranks (group ranks 0..n-1) for restore exchanges
    alone: built on a prefix of the coordinator's store, so creating it is a collective of
    those ranks only (no ``new_group``, which every rank of the world would have to call), and
    never the training group. ``timeout_s`` bounds each of its operations."""

    def __init__(self, coord: Any, timeout_s: float) -> None:
        store = dist.PrefixStore(f"{coord.namespace}/restore-share", tc.group_store(coord.group))
        self.pg: Any = gloo_group(store, coord.rank, coord.world_size, timedelta(seconds=timeout_s), "a restore")

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, where: str) -> None:
        _waited(self.pg.allgather([out], [t]), where)

    def all_reduce_max(self, t: torch.Tensor, where: str) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # the stubs: RedOpType vs ReduceOp
        _waited(self.pg.allreduce([t], opts), where)

    def all_reduce_sum(self, t: torch.Tensor, where: str) -> None:
        _waited(self.pg.allreduce([t]), where)

    def broadcast(self, t: torch.Tensor, root: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self.pg.broadcast([t], opts)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.pg.recv([t], src, tag)


def peer_group(coord: Any, timeout_s: float) -> PeerGroup:
    """``coord``'s ``PeerGroup``, created at its first restore (every rank restores together)."""
    group = getattr(coord, "share_group", None)
    if group is None:
        group = coord.share_group = PeerGroup(coord, timeout_s)
    return group


def bounds(needs: Sequence[np.ndarray]) -> tuple[int, int]:
    """The piece and round sizes for ``needs`` (rows ``fid, lo, hi`` per rank): rounds of
    ``ROUND_SHARE`` of the smallest rank's reads (between ``MIN_ROUND_BYTES`` and
    ``ROUND_BYTES``), pieces of a quarter of that (at least 1 MiB, at most ``PIECE_BYTES``),
    so that a round spreads its reads over the owners. The same on every rank."""
    sizes = [int((a[:, 2] - a[:, 1]).clip(min=0).sum()) for a in needs]
    least = min((n for n in sizes if n > 0), default=0)
    round_bytes = int(min(ROUND_BYTES, max(MIN_ROUND_BYTES, least * ROUND_SHARE)))
    return min(PIECE_BYTES, max(1 << 20, round_bytes // 4)), round_bytes


def make_pieces(needs: Sequence[np.ndarray], piece_bytes: int, round_bytes: int) -> list[Piece]:
    """The ranges (rows ``fid, lo, hi`` per rank) that two or more ranks need, as pieces of at
    most ``piece_bytes`` with owners and rounds; deterministic: every rank computes the same."""
    events: dict[int, list[tuple[int, int, int]]] = {}
    for r, arr in enumerate(needs):
        for fid, lo, hi in arr.tolist():
            if lo < hi:
                ev = events.setdefault(fid, [])
                ev.append((lo, 1, r))
                ev.append((hi, -1, r))
    pieces: list[Piece] = []
    load = [0] * len(needs)
    for fid in sorted(events):
        ev = sorted(events[fid])
        count = [0] * len(needs)
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        for i, (pos, delta, r) in enumerate(ev):
            count[r] += delta
            nxt = ev[i + 1][0] if i + 1 < len(ev) else pos
            if nxt > pos:
                who = tuple(q for q, c in enumerate(count) if c > 0)
                if len(who) > 1:
                    if spans and spans[-1][1] == pos and spans[-1][2] == who:
                        spans[-1] = (spans[-1][0], nxt, who)
                    else:
                        spans.append((pos, nxt, who))
        for lo, hi, who in spans:
            for a in range(lo, hi, piece_bytes):
                b = min(hi, a + piece_bytes)
                owner = min(who, key=lambda q: (load[q], q))
                load[owner] += b - a
                pieces.append(Piece(fid, a, b, who, owner))
    total = 0
    rnd = 0
    for p in pieces:
        if total and total + (p.hi - p.lo) > round_bytes:
            rnd, total = rnd + 1, 0
        p.round = rnd
        total += p.hi - p.lo
    return pieces


class SharedStorage:
    """``inner``, but ranges held in the cache are served from it (the fill's reads)."""

    def __init__(self, inner: Storage, cache: dict[str, list[Piece]], stats: RestoreStats) -> None:
        self._inner = inner
        self._cache = cache  # path -> pieces sorted by lo; changed only between rounds
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        pieces = self._cache.get(path)
        if not pieces:
            self._inner.read_into(path, offset, buffer)
            return
        end = offset + len(buffer)
        pos = offset
        served = 0
        i = max(0, bisect.bisect_right([p.lo for p in pieces], offset) - 1)
        for p in pieces[i:]:
            if p.lo >= end:
                break
            if p.hi <= pos or p.data is None:
                continue
            if p.lo > pos:
                self._inner.read_into(path, pos, buffer[pos - offset : p.lo - offset])
                pos = p.lo
            stop = min(p.hi, end)
            buffer[pos - offset : stop - offset] = memoryview(cast("Buffer", p.data))[pos - p.lo : stop - p.lo]
            served += stop - pos
            pos = stop
        if pos < end:
            self._inner.read_into(path, pos, buffer[pos - offset :])
        if served:
            with self._stats._lock:  # these bytes came from the cache, not the storage
                self._stats.bytes_read -= served


@dataclass
class ReadShare:
    """One restore attempt's exchange on this rank (``group``: from ``peer_group``)."""

    group: PeerGroup
    rank: int
    world_size: int
    step: int = -1
    negotiated: bool = False
    pieces: list[Piece] = field(default_factory=list)

    def negotiate(self, jobs: Sequence[Job] | None, step: int) -> bool:
        """Collective: exchange every rank's job ranges (``None``: this rank's attempt failed);
        True when some range is shared and no rank failed, so ``rounds`` must run."""
        self.negotiated, self.step = True, step
        g = self.group
        arr = np.array([(_fid(j.path), j.lo, j.hi) for j in jobs or ()], dtype=np.int64).reshape(-1, 3)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        where = f"step {step}, rank {self.rank}: the restore exchange (the ranks' read lists)"
        g.all_gather(counts, torch.tensor([len(arr) if jobs is not None else -1]), where)
        ns = [int(c.item()) for c in counts]
        if min(ns) < 0 or sum(ns) == 0:
            return False
        width = max(ns)
        mine = torch.zeros((width, 3), dtype=torch.int64)
        mine[: len(arr)] = torch.from_numpy(arr)
        got = [torch.zeros((width, 3), dtype=torch.int64) for _ in range(self.world_size)]
        g.all_gather(got, mine, where)
        needs = [t[:n].numpy() for t, n in zip(got, ns)]
        self.pieces = make_pieces(needs, *bounds(needs))
        return bool(self.pieces)

    def finish(self) -> None:
        """After an attempt: take part in its negotiation if this rank has not (it failed before)."""
        if not self.negotiated:
            self.negotiate(None, self.step)

    def rounds(
        self, jobs: Sequence[Job], storage: Storage, executor: Executor, stats: RestoreStats
    ) -> Iterator[tuple[Storage, list[Job]]]:
        """Per round: exchange its pieces, then yield the storage to read through and this
        rank's jobs of the round; their pieces are dropped once no later job reads them."""
        paths = {_fid(j.path): j.path for j in jobs}
        by_fid: dict[int, list[Piece]] = {}
        for p in self.pieces:
            if self.rank in p.needers:
                p.path = paths[p.fid]
                by_fid.setdefault(p.fid, []).append(p)
        starts = {fid: [p.lo for p in ps] for fid, ps in by_fid.items()}
        per_round: dict[int, list[Job]] = {}
        uses: list[list[Piece]] = []
        for j in jobs:
            ps = by_fid.get(_fid(j.path), [])
            k = bisect.bisect_right(starts.get(_fid(j.path), []), j.lo)
            touched = [p for p in ps[max(0, k - 1) :] if p.lo < j.hi and p.hi > j.lo]
            for p in touched:
                p.refs += 1
            uses.append(touched)
            per_round.setdefault(max((p.round for p in touched), default=0), []).append(j)
        index = {id(j): i for i, j in enumerate(jobs)}
        cache: dict[str, list[Piece]] = {}
        shared = cast("Storage", SharedStorage(storage, cache, stats))
        last = max((p.round for p in self.pieces), default=0)
        for rnd in range(last + 1):
            for p in self._exchange([p for p in self.pieces if p.round == rnd], storage, executor, stats):
                cache.setdefault(p.path, []).append(p)
            for ps in cache.values():
                ps.sort(key=lambda p: p.lo)
            batch = per_round.get(rnd, [])
            yield shared, batch
            for j in batch:  # they have run: drop the pieces no later job reads
                for p in uses[index[id(j)]]:
                    p.refs -= 1
                    if p.refs == 0:
                        p.data = None
            for path in list(cache):
                cache[path] = [p for p in cache[path] if p.data is not None]

    def _exchange(self, pieces: list[Piece], storage: Storage, executor: Executor, stats: RestoreStats) -> list[Piece]:
        """One round: owners read, all agree on failures, owners send; the pieces this rank holds."""
        me, g = self.rank, self.group
        errors: dict[int, BaseException] = {}

        def read(i: int, p: Piece) -> None:
            buf = _buffer(p.hi - p.lo)
            try:
                storage.read_into(p.path, p.lo, memoryview(cast("Buffer", buf)))
            except Exception as e:  # the needers read it themselves
                errors[i] = e
                return
            p.data = buf
            stats.add_read(p.path, len(buf))

        owned = [(i, p) for i, p in enumerate(pieces) if p.owner == me]
        for f in [executor.submit(read, i, p) for i, p in owned]:
            f.result()
        failed = torch.zeros(max(1, len(pieces)), dtype=torch.int8)
        for i in errors:
            failed[i] = 1
        g.all_reduce_max(failed, f"step {self.step}, rank {me}: the restore exchange (which reads failed)")
        works: list[tuple[Any, Piece, int]] = []
        held: list[Piece] = []
        for i, p in enumerate(pieces):
            if me not in p.needers:
                continue
            if failed[i]:
                log.warning(
                    "step %d: rank %d, the owner of bytes [%d, %d) of %s, could not read them%s; "
                    "ranks %s read them themselves",
                    self.step,
                    p.owner,
                    p.lo,
                    p.hi,
                    p.path,
                    f" ({errors[i]})" if i in errors else "",
                    list(p.needers),
                )
                continue
            if p.owner != me:
                p.data = _buffer(p.hi - p.lo)
            assert p.data is not None
            t = torch.from_numpy(p.data)
            if len(p.needers) == self.world_size:  # every rank needs it: one broadcast, not sends one by one
                works.append((g.broadcast(t, p.owner), p, p.owner))
            elif p.owner == me:
                for n in p.needers:
                    if n != me:
                        works.append((g.send(t, n, i), p, n))
            else:
                works.append((g.recv(t, p.owner, i), p, p.owner))
            if p.owner != me:
                with stats._lock:
                    stats.bytes_received += p.hi - p.lo
            held.append(p)
        for work, p, peer in works:
            where = f"step {self.step}, rank {me}: the restore exchange of bytes [{p.lo}, {p.hi}) of {p.path} with rank {peer}"
            _waited(work, where)
        return held


__all__ = [
    "MIN_ROUND_BYTES",
    "PIECE_BYTES",
    "ROUND_BYTES",
    "ROUND_SHARE",
    "Job",
    "PeerExchangeError",
    "PeerGroup",
    "ReadShare",
    "SharedStorage",
    "bounds",
    "make_pieces",
    "peer_group",
]
