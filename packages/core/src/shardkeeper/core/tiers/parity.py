"""The parity of a save under ``erasure=(k, m)``, computed over the tiers' gloo group (where
it lies and what its record holds: ``placement.py``).

A node's data, as coded, is every file its ranks wrote in the save, as stored (encrypted
files as encrypted), in path order, one after the other; the group's data streams are padded
with zeros to the longest (``erasure.py``). Piece by piece, the data nodes' leaders send
their streams' piece to the m nodes that hold that piece's parity shards; each of those
nodes' leaders codes its shard's piece and appends it to its file. The files and their
records are durable before the save's ranks report, so the local commit of a step stands
for its parity on the holders.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import xxhash

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.tiers.erasure import PIECE_BYTES, Code, parity_length
from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.placement import PARITY_DIR, Group, arrange, parity_name
from shardkeeper.core.tiers.wire import TierGroup

#: gloo tags of the parity's pieces: ``TAG + round * 256 + shard`` (distinct from transfer.py's).
TAG = 1 << 16


def node_files(nodes: NodeMap, listed: Sequence[Any], node: int) -> list[tuple[str, int]]:
    """The files (path, stored size) ``node``'s ranks wrote, in path order (``listed``: every
    rank's ``[[path, size], ...]`` or None)."""
    out = {str(p): int(n) for r in nodes.nodes[node] for p, n in (listed[r] or [])}
    return sorted(out.items())


class Concat:
    """A node's files read as one stream, from ``storage`` (unencrypted, as stored)."""

    def __init__(self, storage: Storage, files: Sequence[tuple[str, int]]) -> None:
        self.storage, self.files = storage, list(files)
        self.length = sum(n for _, n in self.files)

    def read(self, offset: int, buf: memoryview) -> None:
        pos = 0
        start = 0
        for path, size in self.files:
            if pos < len(buf) and offset + pos < start + size:
                a = offset + pos - start
                n = min(size - a, len(buf) - pos)
                self.storage.read_into(path, a, buf[pos : pos + n])
                pos += n
            start += size
            if pos == len(buf):
                return
        if pos != len(buf):
            raise CheckpointError(f"reading past the end of a node's files ({offset + len(buf)} > {self.length})")


def _remove(storage: Storage, path: str) -> None:
    if storage.exists(path):
        storage.delete(path)


def encode_step(
    group: TierGroup, nodes: NodeMap, storage: Storage, step: int, listed: Sequence[Any], k: int, m: int
) -> None:
    """Collective: the parity of ``step`` written on its holders (``storage``: each node's
    directory, unencrypted; ``listed``: every rank's files as the replicas' exchange gathered
    them). Every local failure is agreed on: every rank raises together, and none waits; each
    node's leader then removes what it wrote of the step's parity (best effort, as the data
    files of a failed save), so that nothing of a save that failed stays."""
    where = f"step {step}, rank {group.rank}: the erasure parity"
    error: BaseException | None = None
    job = _Encoding(group, nodes, storage, step, listed, k, m)
    try:
        try:
            job.run()
        except Exception as e:  # this rank's own, or a broken peer's: agreed below
            job.abort()
            group.check()  # (a broken group raises at once: no collective can follow)
            error = e
        group.agree_ok(error, where)
    except BaseException:
        if nodes.is_leader(group.rank):
            _drop(storage, step)
        raise


def _drop(storage: Storage, step: int) -> None:
    """Best effort: this node's parity of ``step`` removed (never through a link: the storage
    refuses, and the first error is the one raised)."""
    path = f"{PARITY_DIR}/{step_dir(step)}"
    try:
        if storage.exists(path):
            storage.delete_dir(path)
    except Exception:  # (already failing)
        pass


@dataclass
class _Shard:
    """Parity ``shard`` of ``group`` as this node holds it: the pieces it codes, their
    digests, its output (opened at its first piece) and two buffers per data node (one
    round's pieces are coded while the next round's arrive)."""

    group: Group
    shard: int
    code: Code
    total: int
    path: str
    bufs: list[list[np.ndarray]]
    pieces: list[int]
    digests: list[str]
    writer: Writer | None = None
    size: int = 0


class _Encoding:
    """One rank's part of ``encode_step``: a data node's leader sends its node's stream to the
    holders of each piece; a holder's leader codes the pieces it holds. Round ``r`` carries
    piece ``r`` of every stream; each rank posts its sends and receives of a round before
    waiting on any, and codes the previous round's pieces while they travel."""

    def __init__(
        self, group: TierGroup, nodes: NodeMap, storage: Storage, step: int, listed: Sequence[Any], k: int, m: int
    ) -> None:
        self.group, self.nodes, self.storage, self.step, self.m = group, nodes, storage, step, m
        self.node = nodes.node_of(group.rank)
        self.leader = nodes.is_leader(group.rank)
        self.groups = arrange(len(nodes.nodes), k, m)
        self.files = [node_files(nodes, listed, n) for n in range(len(nodes.nodes))]
        self.lengths = [sum(s for _, s in f) for f in self.files]
        self.totals = [parity_length([self.lengths[n] for n in g.data]) for g in self.groups]
        self.mine = next(g for g in self.groups if self.node in g.data)
        self.sending = Concat(storage, self.files[self.node])
        self.shards: list[_Shard] = []
        self.failed: list[BaseException] = []  # this rank's first failure: raised after the last round

    def run(self) -> None:
        for g in self.groups if self.leader else ():
            total = self.totals[g.index]
            for j in range(self.m):
                held = [r for r in range(-(-total // PIECE_BYTES)) if g.holder(j, r, self.m) == self.node]
                if not held:
                    continue
                path = parity_name(self.step, g.index, j)
                try:
                    for p in (path + ".json", path):
                        _remove(self.storage, p)  # (a failed save's leftovers)
                except Exception as e:  # the rounds go on: no data node waits on this rank
                    self.failed.append(e)
                bufs = [[np.empty(min(PIECE_BYTES, total), dtype=np.uint8) for _ in g.data] for _ in range(2)]
                self.shards.append(_Shard(g, j, Code(len(g.data), self.m), total, path, bufs, held, []))
        pieces = [np.empty(min(PIECE_BYTES, self.totals[self.mine.index]), dtype=np.uint8) for _ in range(2)]
        self._read(0, pieces[0])
        received: tuple[int, list[_Shard]] | None = None
        for rnd in range(-(-max(self.totals) // PIECE_BYTES)):
            works, live = self._post(rnd, pieces[rnd % 2])
            if received is not None:  # the previous round's pieces coded while this round's travel
                self._code_round(*received)
            self._read(rnd + 1, pieces[(rnd + 1) % 2])  # and the next piece read
            for work, peer in works:
                self.group.wait(
                    work, f"step {self.step}, rank {self.group.rank}: the parity's pieces (with rank {peer})"
                )
            received = (rnd, live)
        if received is not None:
            self._code_round(*received)
        if self.failed:
            raise self.failed[0]
        for s in self.shards:
            assert s.writer is not None
            s.writer.close()
            self._record(s)
        if self.shards:
            for d in (f"{PARITY_DIR}/{step_dir(self.step)}", PARITY_DIR, ""):
                self.storage.sync_dir(d)

    def _post(self, rnd: int, piece: np.ndarray) -> tuple[list[tuple[Any, int]], list[_Shard]]:
        """Post round ``rnd``'s receives (into the shards' buffers ``rnd % 2``: the previous
        round's are being coded) and the sends of ``piece`` (read ahead); returns the works
        (with their peers) and the shards that get a piece in this round."""
        works: list[tuple[Any, int]] = []
        off, slot = rnd * PIECE_BYTES, rnd % 2
        live = [s for s in self.shards if off < s.total and s.group.holder(s.shard, rnd, self.m) == self.node]
        for s in live:
            n = min(PIECE_BYTES, s.total - off)
            for i, d in enumerate(s.group.data):
                src = self.nodes.leader(d)
                works.append((self.group.recv(torch.from_numpy(s.bufs[slot][i][:n]), src, TAG + rnd * 256 + i), src))
        total = self.totals[self.mine.index]
        if self.leader and off < total:
            t = torch.from_numpy(piece[: min(PIECE_BYTES, total - off)])
            index = self.mine.data.index(self.node)
            for j in range(self.m):
                dst = self.nodes.leader(self.mine.holder(j, rnd, self.m))
                works.append((self.group.send(t, dst, TAG + rnd * 256 + index), dst))
        return works, live

    def _read(self, rnd: int, piece: np.ndarray) -> None:
        """A data node's leader: piece ``rnd`` of its node's stream into ``piece``, zeros past
        its end (and after a failure: no holder waits on this rank)."""
        off, total = rnd * PIECE_BYTES, self.totals[self.mine.index]
        if not self.leader or off >= total:
            return
        n = min(PIECE_BYTES, total - off)
        got = 0 if self.failed else max(0, min(n, self.sending.length - off))
        try:
            if got:
                self.sending.read(off, memoryview(cast("Any", piece[:got])))
        except Exception as e:  # zeros go out instead
            self.failed.append(e)
            got = 0
        piece[got:n] = 0

    def _code_round(self, rnd: int, live: list[_Shard]) -> None:
        off = rnd * PIECE_BYTES
        for s in live if not self.failed else ():
            try:
                self._code(s, s.bufs[rnd % 2], min(PIECE_BYTES, s.total - off))
            except Exception as e:  # the rounds go on: no data node waits on this rank
                self.failed.append(e)

    def _code(self, s: _Shard, bufs: list[np.ndarray], n: int) -> None:
        block = s.code.encode([b[:n] for b in bufs], [s.shard])[0]
        s.digests.append(xxhash.xxh3_128_hexdigest(memoryview(cast("Any", block))))
        if s.writer is None:
            s.writer = self.storage.open_writer(s.path)
        s.writer.write(memoryview(cast("Any", block)))
        s.size += n

    def _record(self, s: _Shard) -> None:
        data = s.group.data
        record = {
            "step": self.step,
            "group": s.group.index,
            "shard": s.shard,
            "k": len(data),
            "m": self.m,
            "code": s.code.name,
            "nodes": list(data),
            "members": [[list(f) for f in self.files[n]] for n in data],
            "lengths": [self.lengths[n] for n in data],
            "length": s.total,
            "piece_bytes": PIECE_BYTES,
            "pieces": s.pieces,
            "digests": s.digests,
            "size": s.size,
        }
        w = self.storage.open_writer(s.path + ".json")
        w.write(json.dumps(record, sort_keys=True).encode())
        w.close()

    def abort(self) -> None:
        for s in self.shards:
            try:
                if s.writer is not None:
                    s.writer.abort()
            except Exception:  # already failing: the first error is the one raised
                pass


__all__ = ["Concat", "encode_step", "node_files"]
