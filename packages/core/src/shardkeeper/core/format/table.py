"""The leaves of a table-form manifest (``TableLeaves``): leaf records made on first access
from the chunk and leaf tables, and the chunks a restore needs found without making the rest.

Layering: the top of the table modules, which it also names for their importers (the
columns, format/columns.py; the checks, format/table_checks.py; the coordinator's reports,
format/reports.py), so that ``shardkeeper.core.format.table`` keeps the names it always had. It makes the records of
format/records.py; format/leaves.py chooses between these leaves and the per-chunk form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from shardkeeper.core.format.columns import (
    DIGEST_HEX,
    TABLE_MIN_CHUNKS,
    ChunkTable,
    gather,
    no_gc,
    without_gc,
)
from shardkeeper.core.format.described import DescribedLeaves
from shardkeeper.core.format.leaf_table import LeafTable
from shardkeeper.core.format.records import BlockDigests, ChunkRecord, LeafRecord
from shardkeeper.core.format.reports import (
    decode_report,
    encode_report,
    report_for_wire,
    rows_report,
)
from shardkeeper.core.format.table_checks import all_slabs, leaf_chunks_problem, tables_problem


class TableLeaves(Mapping[str, Any]):
    """Leaf records of a table-form manifest, made on first access (like ``LazyLeaves``).

    Tensor and bytes leaves are the rows of a ``LeafTable``, whose chunks are rows of the
    ``ChunkTable``; object leaves keep their JSON form (``objects``). ``overlapping`` finds
    the chunks a restore needs without making the rest.
    """

    def __init__(
        self,
        objects: dict[str, Any],
        leaf_table: LeafTable,
        table: ChunkTable,
        block: int,
        described: DescribedLeaves | None = None,
    ) -> None:
        self.object_leaves = objects  # key -> {"kind": "object", "value": ...}
        self.leaf_table = leaf_table
        self.table = table
        self.block = block
        #: leaves whose chunks follow a rule, in index files (format/described.py), or None
        self.described = described
        self._made: dict[str, Any] = {}
        self._order: list[str] | None = None
        self._dims: list[int] | None = None  # the chunk table's, cached for _record
        self._dig: list[int] | None = None
        self._dim0: tuple[list[int], list[int]] | None = None  # each row's offset and size along dimension 0

    def __iter__(self) -> Iterator[str]:
        if not self.object_leaves and self.described is None:
            return iter(self.leaf_table.keys)
        if self._order is None:
            more = self.described.keys if self.described is not None else []
            self._order = sorted([*self.leaf_table.keys, *self.object_leaves, *more])
        return iter(self._order)

    def __len__(self) -> int:
        return len(self.leaf_table) + len(self.object_leaves) + (len(self.described) if self.described else 0)

    def __contains__(self, key: object) -> bool:
        return (
            key in self.object_leaves
            or key in self.leaf_table.index
            or (self.described is not None and key in self.described.pos)
        )

    def _record(self, i: int) -> Any:
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
        rec = ChunkRecord.unchecked(
            t.paths[t.file[i]], t.offset[i], t.length[i], tuple(t.offsets[a:b]), tuple(t.shape[a:b]), digests
        )
        if t.extras:
            extra = {k: col[i] for k, col in t.extras.items() if col[i] is not None}
            if extra:
                rec = dataclasses.replace(rec, **extra)
        return rec

    def __getitem__(self, key: str) -> Any:
        leaf = self._made.get(key)
        if leaf is None:
            obj = self.object_leaves.get(key)
            if obj is not None:
                leaf = LeafRecord(kind="object", value=obj.get("value"))
            elif self.described is not None and key in self.described.pos:
                leaf = self.described.record(key)
            else:
                lt = self.leaf_table
                j = lt.index[key]
                leaf = LeafRecord(
                    lt.kind[j], lt.dtype[j], lt.shapes()[j], tuple([self._record(i) for i in lt.rows_of(j)])
                )
            self._made[key] = leaf
        return leaf

    def head(self, key: str) -> Any:
        """Leaf ``key`` without its chunks (``overlapping`` finds those), or None."""
        d = self.described
        if d is not None:  # (a manifest of them has few other leaves)
            got = d.head(key)
            if got is not None:
                return got
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
        if self.described is not None and key not in lt.index:
            return self.described.overlapping(key, offsets, shape)
        rows = lt.rows_of(lt.index[key])
        if 0 in shape:
            return []
        t = self.table
        if self._dim0 is None:
            # A row of no dimensions (a scalar) starts where the next row does, or at the end:
            # the padding keeps the gather in range; such rows are never filtered here.
            firsts = t.dims[:-1]
            self._dim0 = (gather([*t.offsets, 0], firsts), gather([*t.shape, 0], firsts))
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

    def overlapping_many(self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[list[Any]]:
        """``overlapping`` for each (key, offsets, shape) of ``boxes``; the described leaves'
        in one batch (``DescribedLeaves.overlapping_many``)."""
        d = self.described
        if d is None:
            return [self.overlapping(*b) for b in boxes]
        index = self.leaf_table.index
        if all(b[0] not in index for b in boxes):
            return d.overlapping_many(boxes)
        out = [self.overlapping(*b) if b[0] in index else None for b in boxes]
        rest = [n for n, got in enumerate(out) if got is None]
        for n, got in zip(rest, d.overlapping_many([boxes[n] for n in rest])):
            out[n] = got
        return cast(list[list[Any]], out)

    def objects(self) -> dict[str, Any]:
        """The object leaves (JSON values), for the checks that apply to them."""
        return self.object_leaves

    def expanded(self) -> dict[str, Any]:
        """Every leaf in the per-chunk JSON form (for checks of optional columns)."""
        out: dict[str, Any] = {}
        for key, shape, _, rows in self.leaf_table.items():
            j = self.leaf_table.index[key]
            out[key] = {
                "kind": self.leaf_table.kind[j],
                "dtype": self.leaf_table.dtype[j],
                "shape": list(shape),
                "chunks": [self.table.record_json(i, self.block) for i in rows],
            }
        out.update(self.object_leaves)
        if self.described is not None:
            for key in self.described.keys:
                out[key] = self[key].to_json()
        return out

    def problem(self, files: Mapping[str, Any], world_size: int = 1) -> str | None:
        """Why the leaves and the tables cannot be trusted, or None (see ``Manifest.problem``);
        linear in the number of rows. Described leaves' chunks are checked when their index
        files are read."""
        why = tables_problem(self.object_leaves, self.leaf_table, self.table, self.block, files)
        if why is None and self.described is not None:
            why = self.described.problem(world_size, files)
            keys = self.described.keys
            others = self.leaf_table.index.keys(), self.object_leaves.keys()
            both = [] if all(o.isdisjoint(keys) for o in others) else [k for k in keys if any(k in o for o in others)]
            if why is None and both:
                why = f"{both[0]}: both a described leaf and another leaf"
        return why


__all__ = [
    "DIGEST_HEX",
    "TABLE_MIN_CHUNKS",
    "ChunkTable",
    "LeafTable",
    "TableLeaves",
    "all_slabs",
    "decode_report",
    "encode_report",
    "leaf_chunks_problem",
    "no_gc",
    "report_for_wire",
    "rows_report",
    "without_gc",
]
