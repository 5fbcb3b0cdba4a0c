"""The chunk reports ranks send to the coordinator: a rank's chunk records as one
``ChunkTable`` (``keys``, ``counts`` per key, the ``table``), not one JSON object per chunk.

Layering: a wire form over format/columns.py, apart from the manifest's own use of the
tables; the coordinator (runtime/coordinator.py) and the manifest's assembly (commit/merge.py)
use it, the format's readers do not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardkeeper.core.format.columns import ChunkTable


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


__all__ = ["decode_report", "encode_report", "report_for_wire", "rows_report"]
