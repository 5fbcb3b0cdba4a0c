"""Index files (docs/format.md 3.8): a rank's chunks of described leaves,
one row of a chunk table each, beside its shard files; their bytes, and what a reader checks
of them once their size and digest matched the manifest's (or their page's) record.

Layering: over the chunk table's columns (format/columns.py); format/described.py reads them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from shardkeeper.core.errors import UntrustedJSONError
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.untrusted import loads_untrusted, strings_only

#: An index file larger than this is refused before it is read.
MAX_INDEX_BYTES = 1 << 28
INDEX_SCHEMA = 1

#: A parsed index file: each key's row (an int), or (first row, rows) for a key of several
#: consecutive rows (a flat partition's boxes); the table, its digest starts and dims.
Index = tuple[dict[str, int | tuple[int, int]], ChunkTable, list[int], list[int]]


def encode_index(step: int, rank: int, keys: Sequence[str], table: ChunkTable) -> bytes:
    """A rank's index file: its chunks of described leaves, row ``i`` the one of ``keys[i]``."""
    doc = {"index_schema": INDEX_SCHEMA, "step": step, "rank": rank, "keys": list(keys), "table": table.to_json()}
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_index(data: bytes, *, rank: int, step: int | None, width: int, block: int) -> Index:
    """Rank ``rank``'s index file of ``step`` (None: any), checked; raises ``ValueError``
    saying what is wrong (the caller names the file)."""
    try:
        doc = loads_untrusted(data, max_bytes=MAX_INDEX_BYTES)
        keys = doc["keys"]
        table = ChunkTable.from_json(doc["table"], width)
        why = table.problem(block)
        if why is None and (not isinstance(keys, list) or len(keys) != len(table)):
            why = "lists another number of keys than rows"
        if why is None and (type(doc.get("rank")) is not int or doc.get("rank") != rank):
            why = f"says it is rank {doc.get('rank')!r}'s"
        if why is None and doc.get("index_schema") != INDEX_SCHEMA:
            why = f"has index_schema {str(doc.get('index_schema'))[:20]}, not {INDEX_SCHEMA}"
        if why is None and step is not None and (type(doc.get("step")) is not int or doc["step"] != step):
            why = f"says it is of step {str(doc.get('step'))[:20]}"
    except UntrustedJSONError as e:
        why = str(e)
    except (ValueError, TypeError, LookupError, AttributeError) as e:
        why = f"is malformed ({type(e).__name__}: {str(e)[:120]})"
    if why is not None:
        raise ValueError(why)
    if not strings_only(keys):
        raise ValueError("lists a key that is not a string")
    # Each key's row, or its run of consecutive rows (a flat partition's boxes); built in C
    # when every key has one row (a restore of 100,000 tensors parses 100,000 keys).
    rows: dict[str, int | tuple[int, int]] = dict(zip(keys, range(len(keys))))
    if len(rows) != len(keys):
        rows = {}
        for i, k in enumerate(keys):
            got = rows.get(k)
            if got is None:
                rows[k] = i
                continue
            first, n = (got, 1) if isinstance(got, int) else got
            if first + n != i:
                raise ValueError(f"lists the rows of {k[:80]!r} apart")
            rows[k] = (first, n + 1)
    return rows, table, table.digest_starts(block), table.dims


__all__ = ["INDEX_SCHEMA", "MAX_INDEX_BYTES", "Index", "encode_index", "parse_index"]
