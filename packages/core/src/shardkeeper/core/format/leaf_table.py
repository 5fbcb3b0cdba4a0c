"""The tensor and bytes leaves of a table-form manifest as columns (docs/format.md 3.7).

Apart from the chunk table (format/columns.py) because it is its own record: seven columns
that name each leaf and its rows in the chunk table. Its checks here need nothing but its own
values; what relates it to the chunk table is in format/table_checks.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from shardkeeper.core.format.columns import MAX_NDIM
from shardkeeper.core.format.records import DTYPES


class LeafTable:
    """The tensor and bytes leaves of a table-form manifest as columns.

    Leaf ``j``: ``keys[j]``, ``kind[j]``, ``dtype[j]``, shape ``shape[sdims[j]:sdims[j+1]]``
    (``ndim`` values each), and its chunks: chunk-table rows ``rows[rdims[j]:rdims[j+1]]``
    (``nrows`` each). 100,000 leaves parse as seven JSON arrays instead of 100,000 objects.
    """

    __slots__ = ("keys", "kind", "dtype", "ndim", "shape", "nrows", "rows", "_index", "_shapes", "_rdims")

    def __init__(
        self,
        keys: list[str],
        kind: list[str],
        dtype: list[str],
        ndim: list[int],
        shape: list[int],
        nrows: list[int],
        rows: list[int],
    ) -> None:
        self.keys, self.kind, self.dtype, self.ndim, self.shape = keys, kind, dtype, ndim, shape
        self.nrows, self.rows = nrows, rows
        self._index: dict[str, int] | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._rdims: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "kind": self.kind,
            "dtype": self.dtype,
            "ndim": self.ndim,
            "shape": self.shape,
            "nrows": self.nrows,
            "rows": self.rows,
        }

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
        if self.ndim and max(self.ndim) > MAX_NDIM:
            return f"a leaf has more than {MAX_NDIM} dimensions"
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

    def items(self) -> list[tuple[str, tuple[int, ...], int, list[int]]]:
        """``(key, shape, item size, rows)`` of every leaf."""
        isz = {d: DTYPES[d][1] for d in set(self.dtype)}
        return [
            (k, shape, isz[d], self.rows_of(j))
            for j, (k, shape, d) in enumerate(zip(self.keys, self.shapes(), self.dtype))
        ]


__all__ = ["LeafTable"]
