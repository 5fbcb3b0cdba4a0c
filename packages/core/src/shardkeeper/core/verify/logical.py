"""``verify --logical``: each leaf's logical digest (docs/format.md 6.1) recomputed from its
stored chunks and compared with the one its save recorded. Torch-free.

Chunk digests prove that each chunk holds the bytes written; this proves that the chunks
together form the tensor the save summed. A writer that put a piece at a wrong offset, wrote
one twice or left one out commits chunks that pass every digest, and a restore assembles the
wrong tensor from them. The sums ride on verify's own reads (``verify/checks.py``), so the
step is still read once: each window of a raw chunk is summed as it is read (its elements
cut into at most ``2 * ndim - 1`` boxes, ``flat_boxes``); an encoded chunk is gathered and
decoded once its stored bytes passed their digests (memory: one chunk's stored and decoded
bytes). A leaf is judged only when every chunk of it was summed whole: damage verify reports
otherwise leaves it "not checked".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.codec.read import ChunkReader
from shardkeeper.core.format.logical import ALGORITHM, MASK, Box, box_sums, finalize
from shardkeeper.core.format.logical_member import digests_of, tensor_keys
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord
from shardkeeper.core.verify.report import Collector, LogicalTally, VerifyReport


def flat_boxes(size: Sequence[int], lo: int, hi: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``lo .. hi - 1`` (row-major) of a box of shape ``size`` as sub-boxes
    ``(offsets, shape)`` in that order, each a consecutive part of the flat order: partial
    slices at the ends, whole slices of the outermost dimension in between."""
    n = len(size)
    if lo >= hi:
        return
    if n == 0:
        yield (), ()
        return
    strides = [math.prod(size[d + 1 :]) for d in range(n)]

    def part(d: int, prefix: tuple[int, ...], a: int, b: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        st = strides[d]
        whole = (0,) * (n - d - 1), tuple(size[d + 1 :])
        if a % st == 0 and b % st == 0:  # whole slices of dimension d
            yield prefix + (a // st,) + whole[0], (1,) * d + (b // st - a // st,) + whole[1]
            return
        i, j = a // st, b // st  # the slices a and b fall in
        if i == j:
            yield from part(d + 1, prefix + (i,), a - i * st, b - i * st)
            return
        if a % st:
            yield from part(d + 1, prefix + (i,), a - i * st, st)
            i += 1
        if i < j:
            yield prefix + (i,) + whole[0], (1,) * d + (j - i,) + whole[1]
        if b % st:
            yield from part(d + 1, prefix + (j,), 0, b - j * st)

    yield from part(0, (), lo, hi)


@dataclass
class _Leaf:
    kind: str  # how messages name it: "tensor" or "bytes leaf"
    dtype: str
    shape: tuple[int, ...]
    chunks: int  # how many it has
    sound: bool  # its chunks tile it (else verify said so, and it is not judged)
    summed: int = 0  # chunks summed whole
    total: int = 0


class ChunkSum:
    """The sum of chunk ``c`` of a tensor of ``shape`` as verify reads its stored bytes in
    windows (``feed``, in order); ``finish`` adds it to ``leaf``'s."""

    def __init__(self, shape: tuple[int, ...], c: ChunkRecord, isz: int, leaf: _Leaf | None = None) -> None:
        self.shape, self.c, self.isz, self.leaf = shape, c, isz, leaf
        self.total = 0
        self.done = 0  # raw: elements summed
        self.carry = b""  # raw: the start of an element a window cut
        self.stored = bytearray() if c.encoding != "raw" else None

    def feed(self, data: memoryview) -> None:
        if self.stored is not None:
            self.stored += data
            return
        isz = self.isz
        if self.carry:
            need = isz - len(self.carry)
            self.carry += bytes(data[:need])
            data = data[need:]
            if len(self.carry) < isz:
                return
            self._sum(memoryview(self.carry), 1)
        n = len(data) // isz
        if n:
            self._sum(data[: n * isz], n)
        self.carry = bytes(data[n * isz :])

    def _sum(self, data: memoryview, n: int) -> None:
        c, isz = self.c, self.isz
        parts: list[tuple[Any, int, Box]] = []
        at = 0
        for offs, size in flat_boxes(c.shape, self.done, self.done + n):
            k = math.prod(size)
            box = Box(self.shape, [a + b for a, b in zip(c.offsets, offs)], size)
            parts.append((data[at * isz : (at + k) * isz], isz, box))
            at += k
        self.total = (self.total + sum(box_sums(parts))) & MASK
        self.done += n

    def finish(self, reader: ChunkReader | None, path: str, key: str) -> bool:
        """Whether the chunk was summed whole (``total``), then added to its leaf's: an encoded
        chunk is decoded first by ``reader`` (a ``CorruptCheckpointError`` when it does not
        decode); a raw one not fed whole is not."""
        c, isz = self.c, self.isz
        if self.stored is not None:
            if reader is None:
                raise ValueError("an encoded chunk's sum needs the reader that decodes it")
            out = bytearray(c.numel * isz)
            stored, self.stored = self.stored, None
            reader.decode(path, c, memoryview(stored), memoryview(out), key, isz)
            del stored
            self.total = box_sums([(out, isz, Box(self.shape, c.offsets, c.shape))])[0]
        elif self.done != c.numel or self.carry:
            return False
        if self.leaf is not None:
            self.leaf.summed += 1
            self.leaf.total = (self.leaf.total + self.total) & MASK
        return True


class LogicalSums:
    """A step's logical check: the digests its manifest records, the sums of the leaves
    verify reads (``leaf``, then ``chunk`` for each chunk it reads), and the verdict (``judge``)."""

    def __init__(self, m: Manifest) -> None:
        recorded = digests_of(m.logical, m.leaves)
        self.unknown = ""  # the member's algorithm, when this version does not know it
        if recorded is None:
            if isinstance(m.logical, dict) and m.logical.get("algorithm") != ALGORITHM:
                self.unknown = str(m.logical.get("algorithm"))
            recorded = dict.fromkeys(tensor_keys(m.leaves))
        self.recorded: dict[str, str | None] = recorded
        self.leaves: dict[str, _Leaf] = {}

    def leaf(self, key: str, leaf: LeafRecord, chunks: int, sound: bool) -> None:
        if self.recorded.get(key) is not None:
            self.leaves[key] = _Leaf(
                "tensor" if leaf.kind == "tensor" else "bytes leaf", leaf.dtype, tuple(leaf.shape), chunks, sound
            )

    def chunk(self, key: str, c: ChunkRecord, isz: int) -> ChunkSum | None:
        """The sum of ``c`` to feed, None when its leaf is not judged."""
        leaf = self.leaves.get(key)
        return ChunkSum(leaf.shape, c, isz, leaf) if leaf is not None and leaf.sound else None

    def judge(self, out: Collector, report: VerifyReport, url: str) -> None:
        """Compare every leaf summed whole with its record: a mismatch is a ``logical`` problem."""
        tally = LogicalTally(algorithm=self.unknown)
        step = report.step
        for key, want in self.recorded.items():
            leaf = self.leaves.get(key)
            if self.unknown:
                tally.not_checked += 1
            elif want is None:
                tally.not_recorded += 1
            elif leaf is None or not leaf.sound or leaf.summed != leaf.chunks:
                tally.not_checked += 1  # (its damage is reported as such)
            else:
                tally.checked += 1
                got = finalize(leaf.dtype, leaf.shape, leaf.total)
                if got != want:
                    out.add(
                        "logical",
                        f"step {step}: {leaf.kind} {key!r} ({leaf.dtype} {list(leaf.shape)}): its stored chunks form a "
                        f"tensor of logical digest {got}, the save recorded {want}. Every chunk passed its "
                        f"digests, so the bytes are the ones written, but they do not form the tensor the save "
                        f"summed: a writer bug (a piece written at a wrong place, twice or not at all) or an "
                        f"edited manifest. Do not restore this step; an earlier one may be good (check it with "
                        f"`shardkeeper verify {url} STEP --logical`)",
                        key=key,
                        expected=want,
                        found=got,
                    )
        report.logical = tally

    def unread(self, report: VerifyReport) -> None:
        """No byte was read (encrypted, without the key): every recorded digest is unchecked."""
        report.logical = LogicalTally(
            not_recorded=0 if self.unknown else sum(d is None for d in self.recorded.values()),
            not_checked=len(self.recorded) if self.unknown else sum(d is not None for d in self.recorded.values()),
            algorithm=self.unknown,
        )


__all__ = ["ChunkSum", "LogicalSums", "flat_boxes"]
