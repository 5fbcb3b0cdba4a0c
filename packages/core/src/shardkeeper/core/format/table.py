"""The chunk table: the columnar form of a manifest's chunk records (format_version 3).

A manifest of 100,000 tensors sharded over 8 ranks has 800,000 chunks. As one JSON object
per chunk it is ~170 MB and takes seconds to write, parse and check in Python. The table
stores the same records as a few long columns (integers, one string of digests), which JSON
parses in C, and which are checked in linear passes; leaves list the rows of their chunks.
Used when a checkpoint has at least ``TABLE_MIN_CHUNKS`` chunks (smaller manifests keep the
per-chunk form that older readers read). See ``docs/format.md`` section 3.5.

Ranks also send their chunk records to the coordinator in this form (``encode_report``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any

TABLE_VERSION = 3
#: Below this many chunks a manifest keeps one JSON object per chunk (readable by older
#: readers, easier to read by eye); at or above it, the columnar table.
TABLE_MIN_CHUNKS = 4096
#: Hex digits of one block digest, per algorithm: the table's digests are concatenated.
DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}
#: Per-chunk fields every row has (the table's core columns); any other field of a chunk
#: record (``encoding``, ``content``, ...) becomes an optional column (null = absent).
_CORE = ("file", "offset", "length", "offsets", "shape", "digests")
_MAX_NDIM = 64


class ChunkTable:
    """Chunk records as columns. Row ``i``: ``paths[file[i]]``, ``offset[i]``, ``length[i]``,
    box ``offsets``/``shape`` at ``dims[i]:dims[i]+ndim[i]`` of the flat ``offsets``/``shape``
    columns, digests at ``digest_at[i]`` blocks into ``digests`` (``width`` hex digits each)."""

    __slots__ = ("paths", "file", "offset", "length", "ndim", "offsets", "shape", "digests", "extras",
                 "width", "_dims", "_dig")

    def __init__(self, paths: list[str], file: list[int], offset: list[int], length: list[int], ndim: list[int],
                 offsets: list[int], shape: list[int], digests: str, extras: dict[str, list[Any]], width: int) -> None:
        self.paths, self.file, self.offset, self.length, self.ndim = paths, file, offset, length, ndim
        self.offsets, self.shape, self.digests, self.extras, self.width = offsets, shape, digests, extras, width
        self._dims: list[int] | None = None
        self._dig: list[int] | None = None

    def __len__(self) -> int:
        return len(self.offset)

    @classmethod
    def from_records(cls, recs: Sequence[Mapping[str, Any]], width: int) -> ChunkTable:
        """Rows from chunk records in their JSON form (comma-separated digests)."""
        index: dict[str, int] = {}
        paths: list[str] = []
        file = []
        for r in recs:
            f = r["file"]
            i = index.get(f)
            if i is None:
                i = index[f] = len(paths)
                paths.append(f)
            file.append(i)
        offsets: list[int] = []
        shape: list[int] = []
        for r in recs:
            offsets.extend(r["offsets"])
            shape.extend(r["shape"])
        extras: dict[str, list[Any]] = {}
        for n, r in enumerate(recs):
            if len(r) > 6 or not all(k in r for k in _CORE):
                for k, v in r.items():
                    if k not in _CORE:
                        extras.setdefault(k, [None] * len(recs))[n] = v
        return cls(
            paths, file, [r["offset"] for r in recs], [r["length"] for r in recs], [len(r["shape"]) for r in recs],
            offsets, shape, "".join([r["digests"] for r in recs]).replace(",", ""), extras, width,
        )

    @classmethod
    def concat(cls, tables: Sequence[ChunkTable], width: int) -> ChunkTable:
        """One table holding every row of ``tables``, in order (file indices remapped)."""
        index: dict[str, int] = {}
        paths: list[str] = []
        out = cls(paths, [], [], [], [], [], [], "", {}, width)
        total = 0
        for t in tables:
            remap = []
            for p in t.paths:
                i = index.get(p)
                if i is None:
                    i = index[p] = len(paths)
                    paths.append(p)
                remap.append(i)
            out.file.extend([remap[i] for i in t.file] if remap != list(range(len(remap))) else t.file)
            out.offset.extend(t.offset)
            out.length.extend(t.length)
            out.ndim.extend(t.ndim)
            out.offsets.extend(t.offsets)
            out.shape.extend(t.shape)
            for k, col in t.extras.items():
                out.extras.setdefault(k, [None] * total).extend(col)
            total += len(t)
            for col in out.extras.values():
                col.extend([None] * (total - len(col)))
        out.digests = "".join([t.digests for t in tables])
        return out

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"files": self.paths, "file": self.file, "offset": self.offset, "length": self.length,
                             "ndim": self.ndim, "offsets": self.offsets, "shape": self.shape, "digests": self.digests}
        if self.extras:
            d["extras"] = self.extras
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], width: int) -> ChunkTable:
        """Unchecked: ``problem`` checks a table once, before anything relies on it."""
        return cls(d["files"], d["file"], d["offset"], d["length"], d["ndim"], d["offsets"], d["shape"],
                   d["digests"], d.get("extras", {}), width)

    @property
    def dims(self) -> list[int]:
        if self._dims is None:
            self._dims = [0, *accumulate(self.ndim)]
        return self._dims

    def digest_starts(self, block: int) -> list[int]:
        """Index of each row's first digest in ``digests`` (in blocks), plus the total."""
        if self._dig is None:
            self._dig = [0, *accumulate([-(-n // block) for n in self.length])]
        return self._dig

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        a, b = self.dims[i], self.dims[i + 1]
        return tuple(self.offsets[a:b]), tuple(self.shape[a:b])

    def record_json(self, i: int, block: int) -> dict[str, Any]:
        """Row ``i`` as a chunk record in its JSON form."""
        w = self.width
        d0, d1 = self.digest_starts(block)[i : i + 2]
        text = self.digests
        offs, shape = self.box(i)
        rec: dict[str, Any] = {
            "file": self.paths[self.file[i]], "offset": self.offset[i], "length": self.length[i],
            "offsets": list(offs), "shape": list(shape),
            "digests": ",".join([text[j * w : (j + 1) * w] for j in range(d0, d1)]),
        }
        for k, col in self.extras.items():
            if col[i] is not None:
                rec[k] = col[i]
        return rec

    def problem(self, block: int) -> str | None:
        """Why the columns are inconsistent, or None (types, lengths, ranges; linear)."""
        n = len(self.offset)
        cols = (self.file, self.offset, self.length, self.ndim, self.offsets, self.shape)
        if not isinstance(self.paths, list) or not all(isinstance(c, list) for c in cols):
            return "chunk_table columns are not arrays"
        if not all(isinstance(p, str) for p in self.paths):
            return "chunk_table files are not strings"
        if len(self.file) != n or len(self.length) != n or len(self.ndim) != n:
            return "chunk_table columns differ in length"
        for c in cols:
            if c and (not set(map(type, c)) <= {int} or min(c) < 0):
                return "chunk_table columns hold something other than non-negative integers"
        if self.file and max(self.file) >= len(self.paths):
            return "chunk_table row names a file beyond its files"
        if self.ndim and max(self.ndim) > _MAX_NDIM:
            return f"chunk_table row has more than {_MAX_NDIM} dimensions"
        if len(self.offsets) != self.dims[-1] or len(self.shape) != self.dims[-1]:
            return "chunk_table offsets/shape do not match its ndim column"
        if not isinstance(self.digests, str) or not self.digests.isascii():
            return "chunk_table digests are not a string of hex digits"
        if len(self.digests) != self.digest_starts(block)[-1] * self.width:
            return (f"chunk_table digests hold {len(self.digests)} hex digits, its rows need "
                    f"{self.digest_starts(block)[-1]} digests of {self.width}")
        if not isinstance(self.extras, dict) or not all(isinstance(c, list) and len(c) == n for c in self.extras.values()):
            return "chunk_table extras are not columns of its length"
        return None


def encode_report(chunks: Mapping[str, Sequence[Mapping[str, Any]]], width: int) -> dict[str, Any]:
    """A rank's chunk records (key -> records) in the compact form ranks send to the
    coordinator: ``keys``, ``counts`` (rows per key, in order) and the ``table``."""
    keys = list(chunks)
    recs = [r for k in keys for r in chunks[k]]
    table = ChunkTable.from_records(recs, width)
    return {"keys": keys, "counts": [len(chunks[k]) for k in keys], "table": table.to_json()}


def decode_report(chunks: Any, width: int) -> tuple[ChunkTable, dict[str, tuple[int, int]]]:
    """A report's ``chunks`` (per-key records, or ``encode_report``'s form) as a table and
    key -> (first row, row count)."""
    if isinstance(chunks, dict) and "table" in chunks and "keys" in chunks:
        table = ChunkTable.from_json(chunks["table"], width)
        keys, counts = chunks["keys"], chunks["counts"]
    else:
        keys = list(chunks)
        counts = [len(chunks[k]) for k in keys]
        table = ChunkTable.from_records([r for k in keys for r in chunks[k]], width)
    starts = accumulate(counts, initial=0)
    return table, {k: (s, c) for k, s, c in zip(keys, starts, counts)}


def tiling_problem(key: str, shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """``check_tiling_boxes``, with a fast path for slabs along dimension 0 (FSDP, row
    sharding): every box spans the other dimensions whole, and the slabs follow each other."""
    from shardkeeper.core.format.manifest import check_tiling_boxes

    ndim = len(shape)
    if ndim >= 1 and len(boxes) > 1:
        rest = list(shape[1:])
        zeros = [0] * (ndim - 1)
        slabs = []
        for offs, bshape in boxes:
            if len(offs) != ndim or list(offs[1:]) != zeros or list(bshape[1:]) != rest:
                break
            slabs.append((offs[0], bshape[0]))
        else:
            slabs.sort()
            at = 0
            for o, n in slabs:
                if o != at or n <= 0:
                    break
                at = o + n
            else:
                if at == shape[0]:
                    return None
    return check_tiling_boxes(key, shape, boxes)


class TableLeaves(Mapping[str, Any]):
    """Leaf records of a table-form manifest, made on first access (like ``LazyLeaves``).

    ``raw`` maps key -> leaf JSON, where a tensor or bytes leaf lists its chunks' table rows
    under ``rows``; ``overlapping`` finds the chunks a restore needs without making the rest.
    """

    def __init__(self, raw: dict[str, Any], table: ChunkTable, block: int) -> None:
        self.raw = raw
        self.table = table
        self.block = block
        self._made: dict[str, Any] = {}

    def _record(self, i: int) -> Any:
        from shardkeeper.core.format.manifest import ChunkRecord

        return ChunkRecord.from_json(self.table.record_json(i, self.block))

    def __getitem__(self, key: str) -> Any:
        from shardkeeper.core.format.manifest import LeafRecord

        leaf = self._made.get(key)
        if leaf is None:
            d = self.raw[key]
            if d["kind"] == "object":
                leaf = LeafRecord(kind="object", value=d.get("value"))
            else:
                leaf = LeafRecord(d["kind"], d["dtype"], tuple(d["shape"]), tuple([self._record(i) for i in d["rows"]]))
            self._made[key] = leaf
        return leaf

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def overlapping(self, key: str, offsets: Sequence[int], shape: Sequence[int]) -> list[Any]:
        """The chunk records of tensor leaf ``key`` whose boxes intersect the box
        ``offsets``/``shape`` (only those are made)."""
        made = self._made.get(key)
        rows = self.raw[key]["rows"]
        t = self.table
        dims, toffs, tshape = t.dims, t.offsets, t.shape
        hits = []
        for j, i in enumerate(rows):
            a = dims[i]
            for d in range(len(offsets)):
                lo, n = toffs[a + d], tshape[a + d]
                if not (lo < offsets[d] + shape[d] and offsets[d] < lo + n):
                    break
            else:
                if math.prod(shape) > 0:
                    hits.append(made.chunks[j] if made is not None else self._record(i))
        return hits

    def objects(self) -> dict[str, Any]:
        """The object leaves (JSON values), for the checks that apply to them."""
        return {k: d for k, d in self.raw.items() if isinstance(d, dict) and d.get("kind") == "object"}

    def expanded(self) -> dict[str, Any]:
        """Every leaf in the per-chunk JSON form (for checks of optional columns)."""
        out = {}
        for key, d in self.raw.items():
            if isinstance(d, dict) and "rows" in d:
                d = {**d, "chunks": [self.table.record_json(i, self.block) for i in d["rows"]]}
                del d["rows"]
            out[key] = d
        return out

    def problem(self, files: Mapping[str, Any]) -> str | None:
        """Why the leaves and the table cannot be trusted, or None (see ``Manifest.problem``);
        linear in the number of rows. The per-chunk checks of optional columns are left to
        the caller (``expanded`` form) when the table has any."""
        from shardkeeper.core.format.manifest import DTYPES, safe_relative_path

        t = self.table
        why = t.problem(self.block)
        if why is not None:
            return why
        for p in t.paths:
            if not safe_relative_path(p):
                return f"chunk file {p[:80]!r} is not a path inside the root"
        big = 1 << 62
        ends = []
        for p in t.paths:
            rec = files.get(p)  # absent: a reference into another step's files
            size = big if rec is None else rec.get("size_bytes", -1)
            ends.append(size if type(size) is int else -1)
        for f, o, n in zip(t.file, t.offset, t.length):
            if o + n > ends[f]:
                return f"chunk [{o}, {o + n}) lies beyond the end of {t.paths[f][:80]!r}"
        nrows = len(t)
        dims, toffs, tshape, lengths, ndims = t.dims, t.offsets, t.shape, t.length, t.ndim
        key = ""
        try:
            for key, leaf in self.raw.items():
                kind = leaf["kind"]
                if kind == "object":
                    continue  # checked by the caller with the other JSON values
                if kind not in ("tensor", "bytes"):
                    return f"{key}: unknown leaf kind {kind!r}"
                dtype = leaf["dtype"]
                if dtype not in DTYPES:
                    return f"{key}: unknown dtype {dtype!r}"
                isz = DTYPES[dtype][1]
                shape = leaf["shape"]
                if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
                    return f"{key}: shape is not a list of sizes"
                if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
                    return f"{key}: a bytes leaf must be a 1-d uint8 array"
                rows = leaf["rows"]
                if not isinstance(rows, list) or (rows and (not set(map(type, rows)) <= {int} or min(rows) < 0 or max(rows) >= nrows)):
                    return f"{key}: rows is not a list of table rows"
                ndim = len(shape)
                boxes = []
                for i in rows:
                    if ndims[i] != ndim:
                        return f"{key}: chunk has {ndims[i]} dimensions, the tensor {ndim}"
                    a = dims[i]
                    cshape = tshape[a : a + ndim]
                    if lengths[i] != math.prod(cshape) * isz and "encoding" not in t.extras:
                        return f"{key}: chunk of shape {cshape} {dtype} has {lengths[i]} bytes"
                    boxes.append((toffs[a : a + ndim], cshape))
                why = tiling_problem(key, shape, boxes)
                if why is not None:
                    return f"{key}: {why}"
        except (KeyError, TypeError, AttributeError) as e:
            return f"{key}: malformed leaf ({type(e).__name__}: {e})"
        return None
