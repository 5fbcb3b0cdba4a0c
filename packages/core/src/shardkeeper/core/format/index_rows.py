"""One rank's parsed index file as the chunk records a restore asks for (``RankRows``): each
row checked against the box the rule gives it, its stored length and the end its chunk file
has, when it is made.

A restore of 100,000 described tensors makes 100,000 of these records on one rank; the
common row (raw, the rule's box, inside its file) takes one short path, every other one
the full checks with their messages.

Layering: over the index files (format/index_files.py) and the records; format/described.py
keeps one per rank it read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import add, itemgetter, le, sub
from typing import cast

from shardkeeper.core.format.features import ENCODINGS
from shardkeeper.core.format.index_files import Index
from shardkeeper.core.format.records import CHUNK_SLOTS, BlockDigests, ChunkRecord, encoded_length_problem


class RankRows:
    """The rows of rank ``rank``'s index file, and the ends of the chunk files they name
    (``ends_in``: where those ends are recorded, for messages)."""

    __slots__ = ("rank", "rows", "table", "starts", "dims", "ends", "ends_in", "_cols")

    def __init__(self, rank: int, index: Index, ends: Mapping[str, int], ends_in: str) -> None:
        self.rank = rank
        self.rows, self.table, self.starts, self.dims = index
        self.ends, self.ends_in = ends, ends_in
        t = self.table
        encodings = t.extras.get("encoding") if t.extras else None
        self._cols = (t.offsets, t.shape, t.paths, t.file, t.offset, t.length, cast(str, t.digests), t.width, encodings)

    def chunk(self, key: str, offs: tuple[int, ...], box: tuple[int, ...], item: int) -> ChunkRecord | str:
        """The chunk of ``key`` at the box ``offs``/``box`` (``item`` bytes an element), or why
        the file cannot give it (a phrase after "index file ... of rank R")."""
        i = self.rows.get(key)
        if i is None:
            return f"has no chunk of {key!r}, which the layout says rank {self.rank} wrote"
        to, ts, paths, fcol, ocol, lcol, digests, w, encodings = self._cols
        dims = self.dims
        want = [*offs]
        if not isinstance(i, int):  # a flat partition's boxes: the one at these offsets
            first, n = i
            hit = next((r for r in range(first, first + n) if to[dims[r] : dims[r + 1]] == want), None)
            if hit is None:
                return f"has no chunk of {key!r} at {want}+{list(box)}, which the layout says rank {self.rank} wrote"
            i = hit
        a, b = dims[i], dims[i + 1]
        if to[a:b] != want or ts[a:b] != [*box]:
            return f"gives {key!r} the box {to[a:b]}+{ts[a:b]}, its layout {want}+{list(box)}"
        file, offset, length = paths[fcol[i]], ocol[i], lcol[i]
        enc = (encodings[i] if encodings is not None else None) or "raw"
        raw = math.prod(box) * item
        end = self.ends.get(file, -1)
        starts = self.starts
        if enc == "raw" and length == raw and offset + length <= end:  # the common row
            digest = BlockDigests.packed(digests[starts[i] * w : starts[i + 1] * w], w)
            return ChunkRecord.unchecked(file, offset, length, offs, box, digest)
        if enc == "raw":
            why = None if length == raw else f"has {length} bytes for a box of {raw}"
        elif enc not in ENCODINGS:
            why = f"has the unknown encoding {enc[:40]!r}"
        else:
            why = encoded_length_problem(enc, length, raw)
            why = why and why.removeprefix("chunk ")  # ("chunk of KEY with encoding ...")
        if why is None and offset + length > end:
            why = (
                f"points at {file[:80]!r} [{offset}, {offset + length}), beyond the end that file has in the "
                f"chunk_files of {self.ends_in}"
            )
        if why is not None:
            return f"chunk of {key!r} {why}"
        contents = self.table.extras.get("content")
        content = (contents[i] if contents is not None else None) or ""
        digest = BlockDigests.packed(digests[starts[i] * w : starts[i + 1] * w], w)
        return ChunkRecord(file, offset, length, offs, box, digest, enc, content)

    def chunks(
        self, keys: Sequence[str], offs: tuple[int, ...], box: tuple[int, ...], item: int
    ) -> list[ChunkRecord | str]:
        """``chunk`` for each of ``keys`` at one box (leaves of one layout and shape, split
        alike): when every row is the common one (raw, that box, inside its file), checked
        column by column over the gathered rows and made in one loop; else row by row."""
        idx = list(map(self.rows.get, keys))
        if len(idx) < 2 or set(map(type, idx)) != {int}:  # (a missing key, a flat partition's run)
            return [self.chunk(key, offs, box, item) for key in keys]
        to, ts, paths, fcol, ocol, lcol, digests, w, encodings = self._cols
        rows, after = itemgetter(*idx), itemgetter(*map(add, idx, repeat(1)))  # rows i and i + 1
        first: tuple[int, ...] = rows(self.dims)
        files, offsets, lengths = rows(fcol), rows(ocol), rows(lcol)
        nd = len(offs)
        ok = set(lengths) == {math.prod(box) * item} and set(map(sub, after(self.dims), first)) == {nd}
        for d in range(nd if ok else 0):
            at = itemgetter(*map(add, first, repeat(d)))
            ok = ok and set(at(to)) == {offs[d]} and set(at(ts)) == {box[d]}
        if ok and encodings is not None:
            ok = set(rows(encodings)) <= {None, "raw"}
        if ok:
            ends = [self.ends.get(p, -1) for p in paths]
            ok = all(map(le, map(add, offsets, lengths), map(ends.__getitem__, files)))
        if not ok:
            return [self.chunk(key, offs, box, item) for key in keys]  # (says why)
        new, packed = object.__new__, BlockDigests.packed
        s_file, s_offset, s_length, s_offsets, s_shape, s_digests, s_encoding, s_content = CHUNK_SLOTS
        out: list[ChunkRecord | str] = []
        for f, offset, length, a, b in zip(files, offsets, lengths, rows(self.starts), after(self.starts)):
            rec = new(ChunkRecord)
            s_file(rec, paths[f])
            s_offset(rec, offset)
            s_length(rec, length)
            s_offsets(rec, offs)
            s_shape(rec, box)
            s_digests(rec, packed(digests[a * w : b * w], w))
            s_encoding(rec, "raw")
            s_content(rec, "")
            out.append(rec)
        return out


__all__ = ["RankRows"]
