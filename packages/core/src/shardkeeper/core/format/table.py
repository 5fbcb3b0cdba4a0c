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

import functools
import gc
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import Any, TypeVar, cast

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

    def digest_text(self) -> str:
        """Every row's digests, concatenated (the manifest's form)."""
        if isinstance(self.digests, list):
            self.digests = "".join(self.digests).replace(",", "")
        return self.digests

    def to_json(self, *, text: bool = True) -> dict[str, Any]:
        """The JSON form: ``digests`` concatenated (``text``, the manifest's form) or per row."""
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
        return None


def encode_report(chunks: Mapping[str, Sequence[Mapping[str, Any]]], width: int) -> dict[str, Any]:
    """A rank's chunk records (key -> records) in the compact form ranks send to the
    coordinator: ``keys``, ``counts`` (rows per key, in order) and the ``table``."""
    keys = list(chunks)
    recs = [r for k in keys for r in chunks[k]]
    table = ChunkTable.from_records(recs, width)
    return {"keys": keys, "counts": [len(chunks[k]) for k in keys], "table": table.to_json(text=False)}


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


def all_slabs(items: Sequence[tuple[Sequence[int], int, Sequence[int]]], t: ChunkTable, *, check_lengths: bool) -> bool:
    """True if for every ``(shape, item size, rows)`` in ``items`` the rows are slabs along
    dimension 0 listed in order (row sharding, FSDP, or one whole chunk) that tile ``shape``
    exactly, with raw lengths: the common case, checked in a few passes over all rows. False
    means "check leaf by leaf" (``leaf_chunks_problem``), not necessarily an error."""
    perm: list[int] = []
    first: list[int] = []  # position in perm of each leaf's first row
    rest: list[tuple[int, ...]] = []  # expected shape beyond dimension 0, per row
    row_bytes: list[int] = []  # expected bytes per unit of dimension 0, per row
    sizes0: list[int] = []
    for shape, isz, rows in items:
        n = len(rows)
        if not shape or not n:
            return False
        first.append(len(perm))
        perm.extend(rows)
        r = tuple(shape[1:])
        rest.extend([r] * n)
        row_bytes.extend([math.prod(r) * isz] * n)
        sizes0.append(shape[0])
    if not perm:
        return True
    dims, toffs, tshape = t.dims, t.offsets, t.shape
    starts = [dims[i] for i in perm]
    ends = [dims[i + 1] for i in perm]
    if [tuple(tshape[a + 1 : b]) for a, b in zip(starts, ends)] != rest:
        return False  # also catches another number of dimensions
    if any([any(toffs[a + 1 : b]) for a, b in zip(starts, ends)]):
        return False
    o0 = [toffs[a] for a in starts]
    n0 = [tshape[a] for a in starts]
    if 0 in n0:
        return False
    stop = list(map(operator.add, o0, n0))
    expect = [0, *stop[:-1]]  # each slab starts where the previous one ends ...
    for k in first:
        expect[k] = 0  # ... and each leaf's first one at 0
    if o0 != expect:
        return False
    last = [*first[1:], len(perm)]
    if [stop[k - 1] for k in last] != sizes0:
        return False
    if check_lengths and [t.length[i] for i in perm] != list(map(operator.mul, n0, row_bytes)):
        return False
    return True


def leaf_chunks_problem(
    key: str, shape: Sequence[int], isz: int, rows: Sequence[int], t: ChunkTable, *, check_lengths: bool = True
) -> str | None:
    """Why rows ``rows`` of ``t`` are not the chunks of a leaf of ``shape`` (dimensions,
    raw lengths, exact tiling), or None. Gathers columns with list comprehensions and
    recognizes slabs along dimension 0 (row sharding, FSDP) and whole chunks without a
    per-chunk loop; other layouts go through ``check_tiling_boxes``."""
    from shardkeeper.core.format.manifest import check_tiling_boxes

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
            if _slabs_tile(slabs, shape[0]):
                return None
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


class TableLeaves(RawLeaves):
    """Leaf records of a table-form manifest, made on first access (like ``LazyLeaves``).

    ``raw`` maps key -> leaf JSON, where a tensor or bytes leaf lists its chunks' table rows
    under ``rows``; ``overlapping`` finds the chunks a restore needs without making the rest.
    """

    def __init__(self, raw: dict[str, Any], table: ChunkTable, block: int) -> None:
        super().__init__(raw)
        self.table = table
        self.block = block

    def _record(self, i: int) -> Any:
        from shardkeeper.core.format.manifest import BlockDigests, ChunkRecord

        t = self.table
        a, b = t.dims[i], t.dims[i + 1]
        text = t.row_digests(i, self.block)
        extra = {k: col[i] for k, col in t.extras.items() if col[i] is not None}
        return ChunkRecord(t.paths[t.file[i]], t.offset[i], t.length[i], tuple(t.offsets[a:b]), tuple(t.shape[a:b]),
                           BlockDigests(text), **extra)

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

    def head(self, key: str) -> Any:
        """Leaf ``key`` without its chunks (``overlapping`` finds those), or None."""
        from shardkeeper.core.format.manifest import LeafRecord

        made = self._made.get(key)
        if made is not None:
            return made
        d = self.raw.get(key)
        if d is None:
            return None
        if d["kind"] == "object":
            return self[key]
        return LeafRecord(d["kind"], d["dtype"], tuple(d["shape"]))

    def overlapping(self, key: str, offsets: Sequence[int], shape: Sequence[int]) -> list[Any]:
        """The chunk records of tensor leaf ``key`` whose boxes intersect the box
        ``offsets``/``shape`` (only those are made)."""
        rows = self.raw[key]["rows"]
        if math.prod(shape) == 0:
            return []
        t = self.table
        dims, toffs, tshape = t.dims, t.offsets, t.shape
        nd = len(offsets)
        if nd:  # dimension 0 first: it rules out most chunks of a sharded tensor
            lo, hi = offsets[0], offsets[0] + shape[0]
            rows = [i for i in rows if toffs[dims[i]] < hi and lo < toffs[dims[i]] + tshape[dims[i]]]
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
        check_lengths = "encoding" not in t.extras
        items = []
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
                shape = leaf["shape"]
                if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
                    return f"{key}: shape is not a list of sizes"
                if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
                    return f"{key}: a bytes leaf must be a 1-d uint8 array"
                rows = leaf["rows"]
                if not isinstance(rows, list) or (rows and (not set(map(type, rows)) <= {int} or min(rows) < 0 or max(rows) >= nrows)):
                    return f"{key}: rows is not a list of table rows"
                items.append((key, shape, DTYPES[dtype][1], rows))
            if all_slabs([it[1:] for it in items], t, check_lengths=check_lengths):
                return None
            for key, shape, isz, rows in items:
                why = leaf_chunks_problem(key, shape, isz, rows, t, check_lengths=check_lengths)
                if why is not None:
                    return f"{key}: {why}"
        except (KeyError, TypeError, AttributeError) as e:
            return f"{key}: malformed leaf ({type(e).__name__}: {e})"
        return None
