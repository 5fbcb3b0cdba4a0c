"""Whole files from one node's directory to another's, over the tiers' gloo group: peer
replicas during a save, and a node's copy of a step made whole from its peers at restore.

Every rank calls ``move_files`` with the same plan (``Move``: a file, its size, the rank that
sends it and the rank that takes it). The moves between one pair of ranks form a stream, cut
into pieces of at most ``PIECE_BYTES``; round ``k`` carries the ``k``-th piece of every
stream, and each rank posts all its sends and receives of a round before it waits on any, so
no order of waits can deadlock. Each stream ends with a trailer of the xxh3-128 digest of
every file as the sender read it from its disk; the receiver hashes what arrived, writes it
durably (fsync, then its directories) and raises on any difference, leaving nothing behind.
The chunk reader checks every byte against the manifest's digests again when it is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import xxhash

from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.tiers.wire import TierGroup

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: The largest piece of a file sent at once (a stream holds one in memory at a time).
PIECE_BYTES = 64 << 20
_TRAIL_LEN, _TRAIL, _DATA = 1, 2, 8
_ERROR = "\u0000error"  # a trailer's key for a sender that failed (never a path)


@dataclass(frozen=True)
class Move:
    path: str  # root-relative
    size: int
    src: int
    dst: int


def remove_copy(storage: Storage, path: str) -> None:
    """Remove whatever stands at ``path`` on this node before a good copy is received there:
    a file, a link, or a directory made in its place (unlink refuses that one)."""
    try:
        storage.delete(path)
    except CheckpointError:
        storage.delete_dir(path)
    if storage.exists(path):
        raise CheckpointError(f"{storage.describe(path)} could not be removed to receive a good copy in its place")


def _pieces(size: int) -> int:
    return max(1, -(-size // PIECE_BYTES))


def move_files(group: TierGroup, storage: Storage, plan: Sequence[Move], where: str) -> list[str]:
    """Collective: carry out ``plan`` (the same on every rank) on ``storage``, each node's own
    directory without encryption (files travel as written); the paths this rank received.

    A rank whose own read, open or write fails keeps taking part in every round (sending
    filler, dropping what arrives) and says so in its trailers, so no peer waits for it; every
    rank then raises: the failing one its own error, its receivers the sender's."""
    me = group.rank
    streams: dict[tuple[int, int], list[Move]] = {}
    for m in plan:
        if me in (m.src, m.dst) and m.src != m.dst:
            streams.setdefault((m.src, m.dst), []).append(m)
    if not streams:
        return []
    t = _Transfer(storage, me, streams)
    _run_rounds(group, t, where)
    failure = t.failed[0] if t.failed else None
    try:
        trails = _trailers(group, streams, t.hashes, failure, where)
        if failure is not None:
            raise failure
        received = _accept(t, trails, where)
        _sync_parents(storage, received)
        return received
    finally:
        _abort(t.writers)


#: A piece received: its stream, its file, and the buffer it arrives in.
_Received = tuple[tuple[int, int], Move, np.ndarray]


class _Transfer:
    """This rank's side of a transfer: its streams cut into pieces, a running digest of each
    file, the writers of the files it receives, and its first failure (reads and writes run on
    threads; after one, the rounds go on with filler)."""

    def __init__(self, storage: Storage, me: int, streams: dict[tuple[int, int], list[Move]]) -> None:
        self.storage, self.me, self.streams = storage, me, streams
        self.pieces = {pair: [(m, k) for m in moves for k in range(_pieces(m.size))] for pair, moves in streams.items()}
        self.hashes = {(pair, m.path): xxhash.xxh3_128() for pair, moves in streams.items() for m in moves}
        self.writers: dict[str, Writer] = {}
        self.failed: list[BaseException] = []

    @property
    def rounds(self) -> int:
        """How many rounds the transfer takes: the most pieces of any stream."""
        return max(len(p) for p in self.pieces.values())

    def read_round(self, rnd: int) -> list[tuple[tuple[int, int], np.ndarray]]:
        """The pieces this rank sends in round ``rnd``, read from its disk, by stream."""
        out = []
        for pair, ps in sorted(self.pieces.items()):
            if pair[0] != self.me or rnd >= len(ps):
                continue
            m, k = ps[rnd]
            buf = np.zeros(min(PIECE_BYTES, m.size - k * PIECE_BYTES), dtype=np.uint8)
            if not self.failed:
                try:
                    if len(buf):
                        self.storage.read_into(m.path, k * PIECE_BYTES, memoryview(cast("Buffer", buf)))
                    self.hashes[(pair, m.path)].update(cast("Buffer", buf))
                except Exception as e:  # said in the trailer; the rounds go on
                    self.failed.append(e)
            out.append((pair, buf))
        return out

    def receive_round(self, group: TierGroup, rnd: int) -> tuple[list[tuple[Any, int]], list[_Received]]:
        """Post the receives of round ``rnd`` (opening a file's writer at its first piece);
        their works with the peer, and the buffers they fill."""
        works: list[tuple[Any, int]] = []
        got: list[_Received] = []
        for pair, ps in sorted(self.pieces.items()):
            if pair[1] != self.me or rnd >= len(ps):
                continue
            m, k = ps[rnd]
            buf = np.zeros(min(PIECE_BYTES, m.size - k * PIECE_BYTES), dtype=np.uint8)
            if k == 0 and not self.failed:
                try:
                    self.writers[m.path] = self.storage.open_writer(m.path)
                except Exception as e:
                    self.failed.append(e)
            works.append((group.recv(torch.from_numpy(buf), pair[0], _DATA + rnd), pair[0]))
            got.append((pair, m, buf))
        return works, got

    def write_round(self, got: list[_Received]) -> None:
        """Hash the pieces that arrived and write them to their files (unless this rank failed)."""
        for pair, m, buf in got:
            self.hashes[(pair, m.path)].update(cast("Buffer", buf))
            if not self.failed and len(buf):
                try:
                    self.writers[m.path].write(memoryview(cast("Buffer", buf)))
                except Exception as e:
                    self.failed.append(e)


def _run_rounds(group: TierGroup, t: _Transfer, where: str) -> None:
    """Send and receive every round of ``t``; the reads of the next round and the writes of the
    last one run beside this round's transfer. On an error the writers are aborted."""
    rounds = t.rounds
    with (
        ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-tier-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-tier-write") as writer,
    ):
        try:
            ahead = reader.submit(t.read_round, 0)
            for rnd in range(rounds):
                sending = ahead.result()
                if rnd + 1 < rounds:
                    ahead = reader.submit(t.read_round, rnd + 1)
                works: list[tuple[Any, int]] = [
                    (group.send(torch.from_numpy(buf), pair[1], _DATA + rnd), pair[1]) for pair, buf in sending
                ]
                receives, got = t.receive_round(group, rnd)
                _wait_all(group, works + receives, where)
                writer.submit(t.write_round, got)
        except BaseException:
            writer.shutdown(wait=True)
            _abort(t.writers)
            raise
        finally:
            writer.shutdown(wait=True)  # every write done (in order) before the trailers and closes


def _accept(t: _Transfer, trails: dict[tuple[int, int], dict[str, str]], where: str) -> list[str]:
    """Check each file this rank received against its sender's digest and close it; the paths,
    in stream order. A sender's failure or a differing digest raises."""
    received = []
    for (src, dst), moves in sorted(t.streams.items()):
        if dst != t.me:
            continue
        sent_error = trails[(src, dst)].get(_ERROR)
        if sent_error is not None:
            raise CorruptCheckpointError(f"{where}: rank {src} could not send its files ({sent_error})")
        for m in moves:
            want, have = trails[(src, dst)].get(m.path), t.hashes[((src, dst), m.path)].hexdigest()
            if want != have:
                raise CorruptCheckpointError(
                    f"{where}: {t.storage.describe(m.path)} from rank {src} arrived with digest {have}, not "
                    f"the sender's {want} (the network or a disk corrupted it)"
                )
        for m in moves:
            t.writers.pop(m.path).close()
            received.append(m.path)
    return received


def _abort(writers: dict[str, Writer]) -> None:
    for w in writers.values():
        try:
            w.abort()
        except Exception:  # already failing: the first error is the one raised
            pass
    writers.clear()


def _sync_parents(storage: Storage, paths: list[str]) -> None:
    """fsync every directory from each file's parent up to the root, deepest first: the step
    directory and ``data/`` are new on a receiving node."""
    dirs: set[str] = set()
    for p in paths:
        parts = p.split("/")[:-1]
        for i in range(len(parts), -1, -1):
            dirs.add("/".join(parts[:i]))
    for d in sorted(dirs, key=lambda d: (-d.count("/") if d else 1, d)):
        storage.sync_dir(d)


def _trailers(
    group: TierGroup,
    streams: dict[tuple[int, int], list[Move]],
    hashes: dict[Any, Any],
    failure: BaseException | None,
    where: str,
) -> dict[tuple[int, int], dict[str, str]]:
    """Each stream's digests, from its sender to its receiver (two rounds: length, bytes)."""
    me = group.rank
    out: dict[tuple[int, int], dict[str, str]] = {}
    lens: dict[tuple[int, int], torch.Tensor] = {}
    blobs: dict[tuple[int, int], torch.Tensor] = {}
    works: list[tuple[Any, int]] = []
    for pair, moves in sorted(streams.items()):
        if pair[0] == me:
            doc = {m.path: hashes[(pair, m.path)].hexdigest() for m in moves}
            if failure is not None:
                doc = {_ERROR: f"{type(failure).__name__}: {failure}"}
            data = json.dumps(doc).encode()
            blobs[pair] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            works.append((group.send(torch.tensor([len(data)]), pair[1], _TRAIL_LEN), pair[1]))
        else:
            lens[pair] = torch.zeros(1, dtype=torch.int64)
            works.append((group.recv(lens[pair], pair[0], _TRAIL_LEN), pair[0]))
    _wait_all(group, works, where)
    works = []
    for pair in sorted(streams):
        if pair[0] == me:
            works.append((group.send(blobs[pair], pair[1], _TRAIL), pair[1]))
        else:
            blobs[pair] = torch.zeros(int(lens[pair].item()), dtype=torch.uint8)
            works.append((group.recv(blobs[pair], pair[0], _TRAIL), pair[0]))
    _wait_all(group, works, where)
    for pair in streams:
        if pair[1] == me:
            out[pair] = json.loads(blobs[pair].numpy().tobytes())
    return out


def _wait_all(group: TierGroup, works: list[tuple[Any, int]], where: str) -> None:
    for work, peer in works:
        group.wait(work, f"{where} (with rank {peer})")


__all__ = ["PIECE_BYTES", "Move", "move_files", "remove_copy"]
