"""The chunk and leaf tables: the columnar form of a large manifest's chunk records
(format_version 3) and tensor leaves (format_version 5, ``LeafTable``).

A manifest of 100,000 tensors sharded over 8 ranks has 800,000 chunks. As one JSON object
per chunk it is ~170 MB and takes seconds to write, parse and check in Python. The table
stores the same records as a few long columns (integers, one string of digests), which JSON
parses in C, and which are checked in linear passes; the leaf table lists each leaf's rows.
Used when a checkpoint has at least ``TABLE_MIN_CHUNKS`` chunks (smaller manifests keep the
per-chunk form, easier to read by eye). See ``docs/format.md`` sections 3.6 and 3.7.

Ranks also send their chunk records to the coordinator in this form (``encode_report``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import accumulate, chain, repeat
from typing import Any, TypeVar, cast

TABLE_VERSION = 3
#: The format_version that stores tensor and bytes leaves as columns too (``LeafTable``).
LEAF_TABLE_VERSION = 5
#: Below this many chunks a manifest keeps one JSON object per chunk (easier to read by eye,
#: and as fast at that size); at or above it, the columnar tables.
TABLE_MIN_CHUNKS = 4096
#: Hex digits of one block digest, per algorithm: the table's digests are concatenated.
DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}
#: Per-chunk fields every row has (the table's core columns); any other field of a chunk
#: record (``encoding``, ``content``, ...) becomes an optional column (null = absent).
_CORE = ("file", "offset", "length", "offsets", "shape", "digests")
#: The optional per-chunk fields a table may carry (``extras``); any other is refused.
EXTRAS = ("encoding", "content")
_MAX_NDIM = 64


@contextmanager
def no_gc() -> Iterator[None]:
    """Cyclic garbage collection paused: parsing and building millions of small lists (which
    form no cycles) otherwise triggers full collections that cost more than the work."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_F = TypeVar("_F", bound=Callable[..., Any])
_V = TypeVar("_V")


def without_gc(fn: _F) -> _F:
    """``fn`` runs with cyclic garbage collection paused (``no_gc``)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with no_gc():
            return fn(*args, **kwargs)

    return cast(_F, run)


class ChunkTable:
    """Chunk records as columns. Row ``i``: ``paths[file[i]]``, ``offset[i]``, ``length[i]``,
    box ``offsets``/``shape`` at ``dims[i]:dims[i]+ndim[i]`` of the flat ``offsets``/``shape``
    columns, digests at ``digest_starts[i]`` blocks into ``digests`` (``width`` hex digits
    each). Built from records (a report), ``digests`` is instead the list of each row's
    comma-separated digests, passed through unchanged to per-chunk records."""

    __slots__ = ("paths", "file", "offset", "length", "ndim", "offsets", "shape", "digests", "extras",
                 "width", "_dims", "_dig")

    def __init__(self, paths: list[str], file: list[int], offset: list[int], length: list[int], ndim: list[int],
                 offsets: list[int], shape: list[int], digests: str | list[str], extras: dict[str, list[Any]], width: int) -> None:
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
            if len(r) > 6:
                for k, v in r.items():
                    if k not in _CORE:
                        extras.setdefault(k, [None] * len(recs))[n] = v
        return cls(
            paths, file, [r["offset"] for r in recs], [r["length"] for r in recs], [len(r["shape"]) for r in recs],
            offsets, shape, [r["digests"] for r in recs], extras, width,
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
        if all(isinstance(t.digests, list) for t in tables):
            out.digests = [d for t in tables for d in t.digests]
        else:
            out.digests = "".join([t.digest_text() for t in tables])
        return out

    def take(self, rows: Sequence[int]) -> ChunkTable:
        """A table of ``rows`` of this one, in that order (digests per row: list form)."""
        if not isinstance(self.digests, list):
            raise TypeError("ChunkTable.take: only a report's table (digests per row) is reordered")
        dims, digests = self.dims, self.digests
        return ChunkTable(
            self.paths, _gather(self.file, rows), _gather(self.offset, rows), _gather(self.length, rows),
            _gather(self.ndim, rows), [v for i in rows for v in self.offsets[dims[i] : dims[i + 1]]],
            [v for i in rows for v in self.shape[dims[i] : dims[i + 1]]], _gather(digests, rows),
            {k: _gather(col, rows) for k, col in self.extras.items()}, self.width,
        )

    def digest_text(self) -> str:
        """Every row's digests, concatenated (the manifest's form)."""
        if isinstance(self.digests, list):
            self.digests = "".join(self.digests).replace(",", "")
        return self.digests

    def to_json(self, *, text: bool = True) -> dict[str, Any]:
        """The JSON form, integer columns packed: ``digests`` concatenated (``text``, the
        manifest's form) or per row (a report's)."""
        d: dict[str, Any] = {"files": self.paths, "file": self.file, "offset": self.offset, "length": self.length,
                             "ndim": self.ndim, "offsets": self.offsets, "shape": self.shape,
                             "digests": self.digest_text() if text else self.digests}
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
        offs, shape = self.box(i)
        rec: dict[str, Any] = {
            "file": self.paths[self.file[i]], "offset": self.offset[i], "length": self.length[i],
            "offsets": list(offs), "shape": list(shape), "digests": self.row_digests(i, block),
        }
        for k, col in self.extras.items():
            if col[i] is not None:
                rec[k] = col[i]
        return rec

    def row_digests(self, i: int, block: int) -> str:
        """Row ``i``'s digests, comma-separated."""
        if isinstance(self.digests, list):
            return self.digests[i]
        w, text = self.width, self.digests
        d0, d1 = self.digest_starts(block)[i : i + 2]
        return ",".join([text[j * w : (j + 1) * w] for j in range(d0, d1)])

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
        unknown = sorted(set(self.extras) - set(EXTRAS))
        if unknown:
            return (f"chunk_table extras has the unknown field {unknown[0][:40]!r} (the per-chunk fields of "
                    f"this format are {', '.join(EXTRAS)})")
        for k, col in self.extras.items():
            if not set(map(type, col)) <= {str, type(None)}:
                return f"chunk_table extras {k!r} holds something other than strings and null"
        return None


def encode_report(chunks: Mapping[str, Sequence[Mapping[str, Any]]], width: int) -> dict[str, Any]:
    """A rank's chunk records (key -> records) in the compact form ranks send to the
    coordinator: ``keys``, ``counts`` (rows per key, in order) and the ``table`` (its
    digests concatenated, as in a manifest: the coordinator joins 8 strings, not 800,000)."""
    keys = list(chunks)
    recs = [r for k in keys for r in chunks[k]]
    table = ChunkTable.from_records(recs, width).to_json()
    return {"keys": keys, "counts": [len(chunks[k]) for k in keys], "table": table}


def rows_report(keys: Sequence[str], table: ChunkTable) -> dict[str, Any]:
    """A rank's chunks as its writer made them, one row of ``table`` per chunk and ``keys[i]``
    the key of row ``i``, in the report's form (``keys``, ``counts``, ``table``): rows of one
    key made adjacent. The table stays an object until it is sent (``report_for_wire``)."""
    first: dict[str, int] = {}
    for k in keys:
        first.setdefault(k, len(first))
    if len(first) != len(keys):  # a key with several chunks in several files: group its rows
        rows = sorted(range(len(keys)), key=lambda i: first[keys[i]])
        table = table.take(rows)
        counts = [0] * len(first)
        for k in keys:
            counts[first[k]] += 1
        return {"keys": list(first), "counts": counts, "table": table}
    return {"keys": list(keys), "counts": [1] * len(keys), "table": table}


def report_for_wire(chunks: Any) -> dict[str, Any]:
    """A report's chunks in the JSON form sent to the coordinator (``encode_report``'s)."""
    if isinstance(chunks, dict) and isinstance(chunks.get("table"), ChunkTable):
        return {**chunks, "table": chunks["table"].to_json()}
    return encode_report(chunks, 0)


def decode_report(chunks: Any, width: int) -> tuple[ChunkTable, list[str], list[int]]:
    """A report's ``chunks`` (per-key records, ``encode_report``'s JSON form or ``rows_report``'s
    with the table as an object) as a table, its keys and each key's row count (rows in key
    order)."""
    if isinstance(chunks, dict) and "keys" in chunks and "counts" in chunks:
        table = chunks.get("table")
        if isinstance(table, ChunkTable):
            return table, list(chunks["keys"]), list(chunks["counts"])
        if isinstance(table, dict):
            return ChunkTable.from_json(table, width), list(chunks["keys"]), list(chunks["counts"])
    keys = list(chunks)
    table = ChunkTable.from_records([r for k in keys for r in chunks[k]], width)
    return table, keys, [len(chunks[k]) for k in keys]


def _gather(col: Sequence[_V], idx: Sequence[int]) -> list[_V]:
    """``[col[i] for i in idx]``, in C."""
    if len(idx) == 1:
        return [col[idx[0]]]
    return list(operator.itemgetter(*idx)(col)) if idx else []


def _expand(values: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    """Each of ``values`` repeated its count of times, in C."""
    return list(chain.from_iterable(map(repeat, values, counts)))


def all_slabs(shapes: Sequence[Sequence[int]], iszs: Sequence[int], counts: Sequence[int], perm: Sequence[int],
              t: ChunkTable, *, check_lengths: bool) -> bool:
    """True if every leaf ``j`` (``shapes[j]``, item size ``iszs[j]``, whose rows are the
    next ``counts[j]`` of ``perm``) has rows that are slabs along dimension 0 listed in order
    (row sharding, FSDP, or one whole chunk) tiling its shape exactly, with raw lengths: the
    common case, checked in a few passes over all rows, in C where the rows share one number
    of dimensions. False means "check leaf by leaf" (``leaf_chunks_problem``), not
    necessarily an error."""
    if 0 in counts or not all(shapes) or len(perm) != sum(counts):
        return False
    if not perm:
        return True
    first = list(accumulate(counts[:-1], initial=0))  # position in perm of each leaf's first row
    nds = set(map(len, shapes))
    nd = len(shapes[0])
    if nds == {nd} and t.ndim.count(nd) == len(t):
        # Dimension d of every row is the column slice offsets[d::nd]; gathers run in C.
        for d in range(1, nd):
            if any(t.offsets[d::nd]):
                return False
            if _gather(t.shape[d::nd], perm) != _expand(list(map(operator.itemgetter(d), shapes)), counts):
                return False
        o0 = _gather(t.offsets[0::nd], perm)
        n0 = _gather(t.shape[0::nd], perm)
    else:
        if _gather(t.ndim, perm) != _expand(list(map(len, shapes)), counts):
            return False  # a row of another number of dimensions than its leaf
        dims, toffs, tshape = t.dims, t.offsets, t.shape
        starts = _gather(dims, perm)
        ends = [dims[i + 1] for i in perm]
        rest = _expand([tuple(s[1:]) for s in shapes], counts)
        if [tuple(tshape[a + 1 : b]) for a, b in zip(starts, ends)] != rest:
            return False  # also catches another number of dimensions
        if any([any(toffs[a + 1 : b]) for a, b in zip(starts, ends)]):
            return False
        o0 = _gather(toffs, starts)
        n0 = _gather(tshape, starts)
    if 0 in n0:
        return False
    stop = list(map(operator.add, o0, n0))
    expect = [0, *stop[:-1]]  # each slab starts where the previous one ends ...
    for k in first:
        expect[k] = 0  # ... and each leaf's first one at 0
    if o0 != expect:
        return False
    last = [k - 1 for k in [*first[1:], len(perm)]]
    if _gather(stop, last) != list(map(operator.itemgetter(0), shapes)):
        return False
    if check_lengths:
        row_bytes = _expand([math.prod(s[1:]) * isz for s, isz in zip(shapes, iszs)], counts)
        if _gather(t.length, perm) != list(map(operator.mul, n0, row_bytes)):
            return False
    return True


def leaf_chunks_problem(
    key: str, shape: Sequence[int], isz: int, rows: Sequence[int], t: ChunkTable, *, check_lengths: bool = True
) -> str | None:
    """Why rows ``rows`` of ``t`` are not the chunks of a leaf of ``shape`` (dimensions,
    raw lengths, exact tiling), or None. Gathers columns with list comprehensions and
    recognizes slabs along dimension 0 (row sharding, FSDP) and whole chunks without a
    per-chunk loop; other layouts go through ``check_tiling_boxes``."""
    check_tiling_boxes = _manifest.check_tiling_boxes

    nd = len(shape)
    ndims = t.ndim
    if [ndims[i] for i in rows] != [nd] * len(rows):
        return f"a chunk has another number of dimensions than the tensor ({nd})"
    dims, toffs, tshape, lengths = t.dims, t.offsets, t.shape, t.length
    starts = [dims[i] for i in rows]
    slab = nd >= 1
    for d in range(1, nd):
        if any([toffs[a + d] for a in starts]) or [tshape[a + d] for a in starts] != [shape[d]] * len(starts):
            slab = False
            break
    if slab:
        n0 = [tshape[a] for a in starts]
        if check_lengths:
            row_bytes = math.prod(shape[1:]) * isz
            if [lengths[i] for i in rows] != [n * row_bytes for n in n0]:
                return "a chunk's length is not its element count times the item size"
        if _slabs_tile(zip([toffs[a] for a in starts], n0), shape[0]):
            return None
    boxes = [(toffs[a : a + nd], tshape[a : a + nd]) for a in starts]
    if check_lengths and not slab:
        for i, (_, cshape) in zip(rows, boxes):
            if lengths[i] != math.prod(cshape) * isz:
                return f"chunk of shape {cshape} has {lengths[i]} bytes"
    return check_tiling_boxes(key, shape, boxes)


def _slabs_tile(slabs: Iterable[tuple[int, int]], rows: int) -> bool:
    """Whether the (first row, row count) slabs, in any order, tile rows [0, rows) exactly."""
    at = 0
    for o, n in sorted(slabs):
        if o != at or n <= 0:
            return False
        at = o + n
    return at == rows


class RawLeaves(Mapping[str, Any]):
    """The keys of a parsed manifest's ``leaves`` JSON (``raw``), with leaf records made on
    first access by the subclass's ``__getitem__`` and kept in ``_made``."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self._made: dict[str, Any] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __contains__(self, key: object) -> bool:
        return key in self.raw


class LeafTable:
    """The tensor and bytes leaves of a table-form manifest as columns (format_version 5).

    Leaf ``j``: ``keys[j]``, ``kind[j]``, ``dtype[j]``, shape ``shape[sdims[j]:sdims[j+1]]``
    (``ndim`` values each), and its chunks: chunk-table rows ``rows[rdims[j]:rdims[j+1]]``
    (``nrows`` each). 100,000 leaves parse as seven JSON arrays instead of 100,000 objects.
    """

    __slots__ = ("keys", "kind", "dtype", "ndim", "shape", "nrows", "rows", "_index", "_shapes", "_rdims")

    def __init__(self, keys: list[str], kind: list[str], dtype: list[str], ndim: list[int], shape: list[int],
                 nrows: list[int], rows: list[int]) -> None:
        self.keys, self.kind, self.dtype, self.ndim, self.shape = keys, kind, dtype, ndim, shape
        self.nrows, self.rows = nrows, rows
        self._index: dict[str, int] | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._rdims: list[int] | None = None

    @classmethod
    def from_leaves(cls, leaves: Mapping[str, Mapping[str, Any]]) -> LeafTable:
        """From ``key -> {"kind", "dtype", "shape", "rows"}`` (format_version 3 and 4 store
        leaves so; the coordinator builds them so)."""
        vals = list(leaves.values())
        shape: list[int] = []
        rows: list[int] = []
        for d in vals:
            shape.extend(d["shape"])
            rows.extend(d["rows"])
        return cls(list(leaves), [d["kind"] for d in vals], [d["dtype"] for d in vals],
                   [len(d["shape"]) for d in vals], shape, [len(d["rows"]) for d in vals], rows)

    def to_json(self) -> dict[str, Any]:
        return {"keys": self.keys, "kind": self.kind, "dtype": self.dtype, "ndim": self.ndim, "shape": self.shape,
                "nrows": self.nrows, "rows": self.rows}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeafTable:
        """Unchecked: ``problem`` checks a table once, before anything relies on it."""
        return cls(d["keys"], d["kind"], d["dtype"], d["ndim"], d["shape"], d["nrows"], d["rows"])

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {k: j for j, k in enumerate(self.keys)}
        return self._index


    def rows_of(self, j: int) -> list[int]:
        if self._rdims is None:
            self._rdims = [0, *accumulate(self.nrows)]
        return self.rows[self._rdims[j] : self._rdims[j + 1]]

    def problem(self, table_rows: int) -> str | None:
        """Why the columns are inconsistent, or None (types, lengths, ranges; linear)."""
        DTYPES = _manifest.DTYPES

        n = len(self.keys) if isinstance(self.keys, list) else -1
        cols = (self.kind, self.dtype, self.ndim, self.shape, self.nrows, self.rows)
        if n < 0 or not all(isinstance(c, list) for c in cols):
            return "leaf_table columns are not arrays"
        if not (len(self.kind) == len(self.dtype) == len(self.ndim) == len(self.nrows) == n):
            return "leaf_table columns differ in length"
        if not all(isinstance(k, str) for k in self.keys) or len(self.index) != n:
            return "leaf_table keys are not distinct strings"
        for c in (self.ndim, self.shape, self.nrows, self.rows):
            if c and (not set(map(type, c)) <= {int} or min(c) < 0):
                return "leaf_table columns hold something other than non-negative integers"
        if self.ndim and max(self.ndim) > _MAX_NDIM:
            return f"a leaf has more than {_MAX_NDIM} dimensions"
        if len(self.shape) != sum(self.ndim) or len(self.rows) != sum(self.nrows):
            return "leaf_table shape/rows do not match its ndim/nrows columns"
        if self.rows and max(self.rows) >= table_rows:
            return "leaf_table rows is not a list of table rows"
        kinds = set(self.kind)
        if not kinds <= {"tensor", "bytes"}:
            return f"unknown leaf kind {sorted(map(str, kinds - {'tensor', 'bytes'}))[0][:40]!r} in leaf_table"
        if not all(isinstance(d, str) and d in DTYPES for d in set(self.dtype)):
            return "unknown dtype in leaf_table"
        if "bytes" in kinds:
            for j, kind in enumerate(self.kind):
                if kind == "bytes" and (self.dtype[j] != "uint8" or self.ndim[j] != 1):
                    return f"{self.keys[j]}: a bytes leaf must be a 1-d uint8 array"
        return None

    def shapes(self) -> list[tuple[int, ...]]:
        """Every leaf's shape, made once (in C when all leaves have one number of dimensions)."""
        if self._shapes is None:
            nd = self.ndim[0] if self.ndim else 0
            if self.ndim.count(nd) == len(self.ndim):
                self._shapes = list(zip(*[self.shape[d::nd] for d in range(nd)])) if nd else [()] * len(self.ndim)
            else:
                sd = [0, *accumulate(self.ndim)]
                self._shapes = [tuple(self.shape[a:b]) for a, b in zip(sd, sd[1:])]
        return self._shapes

    def slabs_tile(self, t: ChunkTable, *, check_lengths: bool) -> bool:
        """``all_slabs`` over every leaf of this table."""
        DTYPES = _manifest.DTYPES

        isz = {d: DTYPES[d][1] for d in set(self.dtype)}
        return all_slabs(self.shapes(), list(map(isz.__getitem__, self.dtype)), self.nrows, self.rows, t,
                         check_lengths=check_lengths)

    def items(self) -> list[tuple[str, tuple[int, ...], int, list[int]]]:
        """``(key, shape, item size, rows)`` of every leaf."""
        DTYPES = _manifest.DTYPES

        isz = {d: DTYPES[d][1] for d in set(self.dtype)}
        return [(k, shape, isz[d], self.rows_of(j)) for j, (k, shape, d) in enumerate(zip(self.keys, self.shapes(), self.dtype))]


class TableLeaves(Mapping[str, Any]):
    """Leaf records of a table-form manifest, made on first access (like ``LazyLeaves``).

    Tensor and bytes leaves are the rows of a ``LeafTable``, whose chunks are rows of the
    ``ChunkTable``; object leaves keep their JSON form (``objects``). ``overlapping`` finds
    the chunks a restore needs without making the rest.
    """

    def __init__(self, objects: dict[str, Any], leaf_table: LeafTable, table: ChunkTable, block: int) -> None:
        self.object_leaves = objects  # key -> {"kind": "object", "value": ...}
        self.leaf_table = leaf_table
        self.table = table
        self.block = block
        self._made: dict[str, Any] = {}
        self._order: list[str] | None = None
        self._dims: list[int] | None = None  # the chunk table's, cached for _record
        self._dig: list[int] | None = None
        self._dim0: tuple[list[int], list[int]] | None = None  # each row's offset and size along dimension 0

    @classmethod
    def from_raw(cls, raw: dict[str, Any], table: ChunkTable, block: int) -> TableLeaves:
        """From the ``leaves`` of format_version 3 and 4, where each tensor or bytes leaf
        lists its table rows under ``rows``."""
        objects = {k: d for k, d in raw.items() if isinstance(d, dict) and d.get("kind") == "object"}
        return cls(objects, LeafTable.from_leaves({k: d for k, d in raw.items() if k not in objects}), table, block)

    def __iter__(self) -> Iterator[str]:
        if not self.object_leaves:
            return iter(self.leaf_table.keys)
        if self._order is None:
            self._order = sorted([*self.leaf_table.keys, *self.object_leaves])
        return iter(self._order)

    def __len__(self) -> int:
        return len(self.leaf_table) + len(self.object_leaves)

    def __contains__(self, key: object) -> bool:
        return key in self.object_leaves or key in self.leaf_table.index

    def _record(self, i: int) -> Any:
        BlockDigests, ChunkRecord = _manifest.BlockDigests, _manifest.ChunkRecord

        t = self.table
        if self._dims is None:
            self._dims = t.dims
            self._dig = t.digest_starts(self.block) if isinstance(t.digests, str) else None
        dims, dig = self._dims, self._dig
        a, b = dims[i], dims[i + 1]
        if dig is not None:
            w = t.width
            digests = BlockDigests.packed(cast(str, t.digests)[dig[i] * w : dig[i + 1] * w], w)
        else:
            digests = BlockDigests(t.digests[i])
        rec = ChunkRecord.unchecked(t.paths[t.file[i]], t.offset[i], t.length[i], tuple(t.offsets[a:b]),
                                    tuple(t.shape[a:b]), digests)
        if t.extras:
            extra = {k: col[i] for k, col in t.extras.items() if col[i] is not None}
            if extra:
                rec = dataclasses.replace(rec, **extra)
        return rec

    def __getitem__(self, key: str) -> Any:
        LeafRecord = _manifest.LeafRecord

        leaf = self._made.get(key)
        if leaf is None:
            obj = self.object_leaves.get(key)
            if obj is not None:
                leaf = LeafRecord(kind="object", value=obj.get("value"))
            else:
                lt = self.leaf_table
                j = lt.index[key]
                leaf = LeafRecord(lt.kind[j], lt.dtype[j], lt.shapes()[j], tuple([self._record(i) for i in lt.rows_of(j)]))
            self._made[key] = leaf
        return leaf

    def head(self, key: str) -> Any:
        """Leaf ``key`` without its chunks (``overlapping`` finds those), or None."""
        LeafRecord = _manifest.LeafRecord

        made = self._made.get(key)
        if made is not None:
            return made
        lt = self.leaf_table
        j = lt.index.get(key)
        if j is None:
            return self[key] if key in self.object_leaves else None
        return LeafRecord.unchecked(lt.kind[j], lt.dtype[j], lt.shapes()[j])

    def overlapping(self, key: str, offsets: Sequence[int], shape: Sequence[int]) -> list[Any]:
        """The chunk records of tensor leaf ``key`` whose boxes intersect the box
        ``offsets``/``shape`` (only those are made)."""
        lt = self.leaf_table
        rows = lt.rows_of(lt.index[key])
        if 0 in shape:
            return []
        t = self.table
        if self._dim0 is None:
            # A row of no dimensions (a scalar) starts where the next row does, or at the end:
            # the padding keeps the gather in range; such rows are never filtered here.
            firsts = t.dims[:-1]
            self._dim0 = (_gather([*t.offsets, 0], firsts), _gather([*t.shape, 0], firsts))
        dims, toffs, tshape = t.dims, t.offsets, t.shape
        nd = len(offsets)
        if nd:  # dimension 0 first: it rules out most chunks of a sharded tensor
            lo, hi = offsets[0], offsets[0] + shape[0]
            o0, n0 = self._dim0
            rows = [i for i in rows if o0[i] < hi and lo < o0[i] + n0[i]]
            if nd == 1:
                return [self._record(i) for i in rows]
        hits = []
        for i in rows:
            a = dims[i]
            for d in range(1, nd):
                if not (toffs[a + d] < offsets[d] + shape[d] and offsets[d] < toffs[a + d] + tshape[a + d]):
                    break
            else:
                hits.append(self._record(i))
        return hits

    def objects(self) -> dict[str, Any]:
        """The object leaves (JSON values), for the checks that apply to them."""
        return self.object_leaves

    def expanded(self) -> dict[str, Any]:
        """Every leaf in the per-chunk JSON form (for checks of optional columns)."""
        out: dict[str, Any] = {}
        for key, shape, _, rows in self.leaf_table.items():
            j = self.leaf_table.index[key]
            out[key] = {"kind": self.leaf_table.kind[j], "dtype": self.leaf_table.dtype[j], "shape": list(shape),
                        "chunks": [self.table.record_json(i, self.block) for i in rows]}
        out.update(self.object_leaves)
        return out

    def problem(self, files: Mapping[str, Any], version: int) -> str | None:
        """Why the leaves and the tables cannot be trusted, or None (see ``Manifest.problem``);
        linear in the number of rows (``version``: the manifest's format_version)."""
        safe_relative_path = _manifest.safe_relative_path

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
        if any(map(operator.gt, map(operator.add, t.offset, t.length), _gather(ends, t.file))):
            for f, o, n in zip(t.file, t.offset, t.length):
                if o + n > ends[f]:
                    return f"chunk [{o}, {o + n}) lies beyond the end of {t.paths[f][:80]!r}"
        lt = self.leaf_table
        why = lt.problem(len(t))
        if why is not None:
            return why
        if len(set(lt.rows)) != len(lt.rows):
            return "a chunk_table row belongs to more than one leaf (or twice to one)"
        for key, d in self.object_leaves.items():
            if not (isinstance(d, dict) and d.get("kind") == "object"):
                return f"{key}: a leaf outside the leaf table that is not an object"
            if "value" not in d:
                return f"{key}: an object leaf without a value"
            if key in lt.index:
                return f"{key}: both an object and a tensor leaf"
        nd = lt.ndim[0] if lt.ndim else 0
        uniform = lt.ndim.count(nd) == len(lt.ndim) and t.ndim.count(nd) == len(t.ndim)  # in C
        if not uniform and _gather(t.ndim, lt.rows) != _expand(lt.ndim, lt.nrows):
            for key, shape, _, rows in lt.items():
                for i in rows:
                    if t.ndim[i] != len(shape):
                        return f"{key}: chunk_table row {i} has {t.ndim[i]} dimensions, the leaf has {len(shape)}"
        check_lengths = "encoding" not in t.extras
        if not check_lengths:  # raw rows' lengths and encoded rows' bounds, row by row
            why = encoded_rows_problem(lt, t, version)
            if why is not None:
                return why
        if lt.slabs_tile(t, check_lengths=check_lengths):
            return None
        for key, shape, isz, rows in lt.items():
            why = leaf_chunks_problem(key, shape, isz, rows, t, check_lengths=check_lengths)
            if why is not None:
                return f"{key}: {why}"
        return None


def encoded_rows_problem(lt: LeafTable, t: ChunkTable, version: int) -> str | None:
    """The checks of ``Manifest.problem`` on the rows of a table with an ``encoding`` column:
    a raw row's length is its box's bytes; an encoded row's encoding is known to ``version``,
    its length positive and within what its box allows (``manifest.encoded_length_problem``)."""
    ENCODINGS, encoded_length_problem = _manifest.ENCODINGS, _manifest.encoded_length_problem

    encoding, dims, shape, length = t.extras["encoding"], t.dims, t.shape, t.length
    for key, _, isz, rows in lt.items():
        for i in rows:
            box = math.prod(shape[dims[i] : dims[i + 1]]) * isz
            enc = encoding[i]
            if enc is None or enc == "raw":
                if length[i] != box:
                    return f"{key}: chunk_table row {i} has {length[i]} bytes, its box {box}"
                continue
            since = ENCODINGS.get(enc)
            if since is None or since > version:
                return f"{key}: chunk encoding {enc[:40]!r} is unknown to format_version {version}"
            why = "encoded chunk without bytes" if length[i] == 0 else encoded_length_problem(enc, length[i], box)
            if why is not None:
                return f"{key}: chunk_table row {i}: {why}"
    return None


# At the end: manifest.py imports this module, and the functions above use its records and
# checks through the module object (an import inside a hot function costs ~0.6 us a call).
from shardkeeper.core.format import manifest as _manifest  # noqa: E402
