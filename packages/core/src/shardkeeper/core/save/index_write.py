"""A rank's chunks of described leaves (format/described.py): split from its report and
written, durably, to its index file beside its shard files, before it reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.index_files import encode_index
from shardkeeper.core.format.layout import data_dir, index_file
from shardkeeper.core.save.logical import split_sums
from shardkeeper.core.save.write import sync_data_dirs, write_durably
from shardkeeper.core.storage.base import Storage


def split_report(
    chunks: dict[str, Any], described: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], ChunkTable | None]:
    """A rank's chunks (a report's ``keys``/``counts``/``table``) split into the report of its
    enumerated leaves and the rows of its described ones (their keys and table)."""
    if not described:
        return chunks, [], None
    keys, counts, table = chunks["keys"], chunks["counts"], chunks["table"]
    keep_rows: list[int] = []
    index_rows: list[int] = []
    keep_keys, keep_counts, index_keys = [], [], []
    row = 0
    for key, n in zip(keys, counts):
        if key in described:
            index_rows.extend(range(row, row + n))
            index_keys.extend([key] * n)
        else:
            keep_rows.extend(range(row, row + n))
            keep_keys.append(key)
            keep_counts.append(n)
        row += n
    if not index_rows:
        return chunks, [], None
    # (no rows left: no file paths either, so the manifest's chunk table names none of them)
    kept = table.take(keep_rows) if keep_rows else ChunkTable([], [], [], [], [], [], [], [], {}, table.width)
    rest = {"keys": keep_keys, "counts": keep_counts, "table": kept}
    return rest, index_keys, table.take(index_rows)


def write_index(
    storage: Storage,
    step_dir: str,
    step: int,
    rank: int,
    attempt: str,
    keys: Sequence[str],
    table: ChunkTable,
    algorithm: str,
    prefixes: int = 1,
) -> tuple[str, int, str, list[list[Any]]]:
    """Write a rank's index file durably: its path, size, digest and the chunk files it names
    with the end of the last byte it references in each."""
    rel = index_file(rank, attempt, prefixes)
    ends: dict[str, int] = {}
    for f, o, n in zip(table.file, table.offset, table.length):
        p = table.paths[f]
        ends[p] = max(ends.get(p, 0), o + n)
    files = [[p, ends[p]] for p in sorted(ends)]
    data = encode_index(step, rank, keys, table)
    write_durably(storage, step_dir, rel, data, data_dir(rank, prefixes))
    return rel, len(data), digest_function(algorithm)(data), files


def index_report(
    storage: Storage,
    step_dir: str,
    step: int,
    rank: int,
    attempt: str,
    chunks: dict[str, Any],
    files: dict[str, dict[str, Any]],
    plan: Any,
    algorithm: str,
    prefixes: int = 1,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """A rank's report members once its shard files are written (``write_shards(...,
    sync=False)``: the directory is made durable here, once, with the index file in it) and
    ``plan`` (a ``SavePlan``) describes leaves: its enumerated chunks, its files with its
    index file, and the ``described`` member (the plan's digest, the index file's entry, the
    chunk files)."""
    before = chunks
    chunks, keys, table = split_report(chunks, plan.described)
    chunks, logical = split_sums(before, chunks, plan.described)
    entry: list[Any] | None = None
    chunk_files: list[list[Any]] = []
    if table is not None:
        rel, size, digest, chunk_files = write_index(
            storage, step_dir, step, rank, attempt, keys, table, algorithm, prefixes
        )
        files = {**files, rel: {"size_bytes": size, "rank": rank}}
        entry = [rel, size, digest]
    elif files:  # no index file to write: the shard files' directory, made durable here
        sync_data_dirs(storage, step_dir, data_dir(rank, prefixes))
    return chunks, files, {"digest": plan.described_digest(), "index": entry, "chunk_files": chunk_files, **logical}


__all__ = ["index_report", "split_report", "write_index"]
