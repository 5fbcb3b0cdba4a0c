"""A manifest's leaves in either form, made into records on first access: the per-chunk
JSON form (``LazyLeaves``) or the tables, with any described leaves (``TableLeaves``,
format/table.py); and the members a manifest reads them from and writes them to
(``read_leaves``, ``leaves_fields``).

A manifest of 100,000 tensors is parsed once; a restore of a few keys, ``ls`` or a retention
pass then pays only for the leaves it touches.

Layering: between the records and tables below (format/records.py, format/table.py) and
the manifest and its checks above (format/manifest.py, format/manifest_checks.py): the one
place that knows which form a manifest's leaves take, so neither of those needs to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from shardkeeper.core.format.columns import DIGEST_HEX, ChunkTable
from shardkeeper.core.format.described import DescribedLeaves
from shardkeeper.core.format.leaf_table import LeafTable
from shardkeeper.core.format.records import LeafRecord
from shardkeeper.core.format.table import TableLeaves


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


class LazyLeaves(RawLeaves):
    """Leaf records made on first access from the manifest's parsed JSON.

    A manifest of 100,000 tensors is parsed once; a restore of a few keys, ``ls`` or a
    retention pass then pays only for the leaves it touches.
    """

    def __getitem__(self, key: str) -> LeafRecord:
        leaf: LeafRecord | None = self._made.get(key)
        if leaf is None:
            leaf = self._made[key] = LeafRecord.from_json(self.raw[key])
        return leaf


def leaves_json(leaves: Mapping[str, LeafRecord]) -> dict[str, Any]:
    if isinstance(leaves, LazyLeaves):
        return leaves.raw
    if isinstance(leaves, TableLeaves):
        return leaves.expanded()
    return {k: v.to_json() for k, v in leaves.items()}


def leaves_fields(leaves: Mapping[str, LeafRecord]) -> dict[str, Any]:
    if isinstance(leaves, TableLeaves):
        out = {
            "leaves": leaves.object_leaves,
            "leaf_table": leaves.leaf_table.to_json(),
            "chunk_table": leaves.table.to_json(),
        }
        if leaves.described is not None:
            out["described"] = leaves.described.to_json()
        return out
    return {"leaves": leaves_json(leaves)}


def read_leaves(d: dict[str, Any]) -> Mapping[str, LeafRecord]:
    """The leaves of a parsed manifest: per-chunk records in ``leaves``; or the ``leaf_table``
    over the ``chunk_table`` beside the object leaves in ``leaves``, and the ``described``
    leaves, if any (docs/format.md 3.6-3.8)."""
    tables = ("chunk_table" in d) + ("leaf_table" in d)
    if tables == 1:
        raise ValueError("a chunk_table without a leaf_table, or a leaf_table without a chunk_table")
    if "described" in d and not tables:
        raise ValueError("a described member without a leaf_table and a chunk_table")
    if not tables:
        return LazyLeaves(_as_dict(d["leaves"]))
    width = DIGEST_HEX.get(str(d["digest_algorithm"]), 0)
    table = ChunkTable.from_json(_as_dict(d["chunk_table"]), width)
    block = int(d["digest_block_bytes"])
    described = DescribedLeaves(_as_dict(d["described"]), width, block) if "described" in d else None
    lt = LeafTable.from_json(_as_dict(d["leaf_table"]))
    return TableLeaves(_as_dict(d["leaves"]), lt, table, block, described)


def _as_dict(x: Any) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise TypeError(f"expected an object, got {type(x).__name__}")
    return x


__all__ = ["LazyLeaves", "RawLeaves", "leaves_fields", "leaves_json", "read_leaves"]
