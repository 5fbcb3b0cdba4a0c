"""The commit's check that a leaf's chunks tile its shape, and what it does with a box that
more than one rank wrote (a replica: counted once, and its logical sums taken from reports
that cover the leaf once).

Torch-free.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import chain
from typing import Any

from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.format.table_checks import all_slabs, leaf_chunks_problem


def tiling_problems(
    keys: list[str], decls: list[list[Any]], rows_list: list[list[int]], table: ChunkTable, problems: list[str]
) -> list[str]:
    """Add a problem for each leaf whose chunks do not tile its shape; returns the leaves whose
    replicas two ranks wrote (each counted once: their rows in ``rows_list`` are deduplicated;
    their logical sums come from ``covering_reports``)."""
    raw_only = "encoding" not in table.extras  # encoded chunks' lengths are their own
    shapes = [d[2] for d in decls]
    item_sizes = [DTYPES[d[1]][1] if d[1] in DTYPES else 1 for d in decls]
    dropped: list[str] = []
    perm = list(chain.from_iterable(rows_list))
    if all_slabs(shapes, item_sizes, list(map(len, rows_list)), perm, table, check_lengths=raw_only):
        return dropped
    for j, key in enumerate(keys):
        rows, shape, item_size = rows_list[j], shapes[j], item_sizes[j]
        why = leaf_chunks_problem(key, shape, item_size, rows, table, check_lengths=raw_only)
        if why is not None and len(rows) > 1:
            # A replica written by more than one rank counts once.
            unique = list({table.box(i): i for i in rows}.values())
            if len(unique) < len(rows):
                rows_list[j] = rows = sorted(unique)
                dropped.append(key)
                why = leaf_chunks_problem(key, shape, item_size, rows, table, check_lengths=raw_only)
        if why is not None:
            problems.append(f"{key}: {why}")
    return dropped


def covering_reports(rows: Sequence[int], table: ChunkTable, bases: Sequence[int]) -> list[int] | None:
    """Reports whose chunks of a leaf that two ranks wrote copies of (FSDP2+TP: each TP rank
    writes the same shards) cover each box once, so their logical sums add up to the leaf's:
    greedily, each report whose boxes are all new. None if they miss a box (no digest)."""
    boxes: dict[int, list[Any]] = {}  # report index -> its boxes of the leaf
    for i in rows:
        boxes.setdefault(bisect_right(bases, i) - 1, []).append(table.box(i))
    covered: set[Any] = set()
    chosen = []
    for n, own in sorted(boxes.items()):
        if len(set(own)) == len(own) and covered.isdisjoint(own):
            covered.update(own)
            chosen.append(n)
    return chosen if covered == {table.box(i) for i in rows} else None


__all__ = ["covering_reports", "tiling_problems"]
