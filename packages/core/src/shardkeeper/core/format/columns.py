"""The chunk and leaf tables as columns: the columnar form of a large manifest's chunk
records (``ChunkTable``); the tensor leaves' table is in format/leaf_table.py.

A manifest of 100,000 tensors sharded over 8 ranks has 800,000 chunks. As one JSON object
per chunk it is ~170 MB and takes seconds to write, parse and check in Python. The table
stores the same records as a few long columns (integers, one string of digests), which JSON
parses in C, and which are checked in linear passes; the leaf table lists each leaf's rows.
Used when a checkpoint has at least ``TABLE_MIN_CHUNKS`` chunks (smaller manifests keep the
per-chunk form, easier to read by eye). See ``docs/format.md`` sections 3.6 and 3.7.

Layering: the columns alone, with the checks that need nothing but their own values (types,
lengths, ranges: ``ChunkTable.problem``, ``LeafTable.problem``). What relates the tables to
each other and to the files (tiling, lengths, encodings) is in format/table_checks.py; the
leaf records made from the tables in format/table.py; the form ranks send their chunks in
to the coordinator in format/reports.py. This module imports only format/records.py.
"""

from __future__ import annotations

import functools
import gc
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import accumulate, chain, repeat
from typing import Any, TypeVar, cast

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
MAX_NDIM = 64


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

    __slots__ = (
        "paths",
        "file",
        "offset",
        "length",
        "ndim",
        "offsets",
        "shape",
        "digests",
        "extras",
        "width",
        "_dims",
        "_dig",
    )

    def __init__(
        self,
        paths: list[str],
        file: list[int],
        offset: list[int],
        length: list[int],
        ndim: list[int],
        offsets: list[int],
        shape: list[int],
        digests: str | list[str],
        extras: dict[str, list[Any]],
        width: int,
    ) -> None:
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
            paths,
            file,
            [r["offset"] for r in recs],
            [r["length"] for r in recs],
            [len(r["shape"]) for r in recs],
            offsets,
            shape,
            [r["digests"] for r in recs],
            extras,
            width,
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
            self.paths,
            gather(self.file, rows),
            gather(self.offset, rows),
            gather(self.length, rows),
            gather(self.ndim, rows),
            [v for i in rows for v in self.offsets[dims[i] : dims[i + 1]]],
            [v for i in rows for v in self.shape[dims[i] : dims[i + 1]]],
            gather(digests, rows),
            {k: gather(col, rows) for k, col in self.extras.items()},
            self.width,
        )

    def digest_text(self) -> str:
        """Every row's digests, concatenated (the manifest's form)."""
        if isinstance(self.digests, list):
            self.digests = "".join(self.digests).replace(",", "")
        return self.digests

    def to_json(self, *, text: bool = True) -> dict[str, Any]:
        """The JSON form, integer columns packed: ``digests`` concatenated (``text``, the
        manifest's form) or per row (a report's)."""
        d: dict[str, Any] = {
            "files": self.paths,
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "ndim": self.ndim,
            "offsets": self.offsets,
            "shape": self.shape,
            "digests": self.digest_text() if text else self.digests,
        }
        if self.extras:
            d["extras"] = self.extras
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], width: int) -> ChunkTable:
        """Unchecked: ``problem`` checks a table once, before anything relies on it."""
        return cls(
            d["files"],
            d["file"],
            d["offset"],
            d["length"],
            d["ndim"],
            d["offsets"],
            d["shape"],
            d["digests"],
            d.get("extras", {}),
            width,
        )

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
            "file": self.paths[self.file[i]],
            "offset": self.offset[i],
            "length": self.length[i],
            "offsets": list(offs),
            "shape": list(shape),
            "digests": self.row_digests(i, block),
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
        if self.ndim and max(self.ndim) > MAX_NDIM:
            return f"chunk_table row has more than {MAX_NDIM} dimensions"
        if len(self.offsets) != self.dims[-1] or len(self.shape) != self.dims[-1]:
            return "chunk_table offsets/shape do not match its ndim column"
        if not isinstance(self.digests, str) or not self.digests.isascii():
            return "chunk_table digests are not a string of hex digits"
        if len(self.digests) != self.digest_starts(block)[-1] * self.width:
            return (
                f"chunk_table digests hold {len(self.digests)} hex digits, its rows need "
                f"{self.digest_starts(block)[-1]} digests of {self.width}"
            )
        if not isinstance(self.extras, dict) or not all(
            isinstance(c, list) and len(c) == n for c in self.extras.values()
        ):
            return "chunk_table extras are not columns of its length"
        unknown = sorted(set(self.extras) - set(EXTRAS))
        if unknown:
            return (
                f"chunk_table extras has the unknown field {unknown[0][:40]!r} (the per-chunk fields of "
                f"this format are {', '.join(EXTRAS)})"
            )
        for k, col in self.extras.items():
            if not set(map(type, col)) <= {str, type(None)}:
                return f"chunk_table extras {k!r} holds something other than strings and null"
        return None


def gather(col: Sequence[_V], idx: Sequence[int]) -> list[_V]:
    """``[col[i] for i in idx]``, in C."""
    if len(idx) == 1:
        return [col[idx[0]]]
    return list(operator.itemgetter(*idx)(col)) if idx else []


def expand(values: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    """Each of ``values`` repeated its count of times, in C."""
    return list(chain.from_iterable(map(repeat, values, counts)))


__all__ = [
    "ChunkTable",
    "DIGEST_HEX",
    "EXTRAS",
    "MAX_NDIM",
    "TABLE_MIN_CHUNKS",
    "expand",
    "gather",
    "no_gc",
    "without_gc",
]
