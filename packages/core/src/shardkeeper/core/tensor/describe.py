"""Which tensor leaves a save records by their rule (described layouts, format/grid.py), and
the split of a rank's chunks between its report and its index file.

A DTensor whose placements are plain Shard and Replicate has chunks that follow torch's
chunk rule; its rank checks its own box against the rule (``describe_leaf``) and, when they
agree, the manifest records the mesh and placements once instead of a chunk per rank. Every
rank decides from the same state alone; the coordinator compares the ranks' decisions
(``described_digest``) and refuses a save on which they differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from shardkeeper.core.format.columns import TABLE_MIN_CHUNKS, ChunkTable
from shardkeeper.core.format.described import encode_index
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.grid import Mesh, cell_box, replicas
from shardkeeper.core.format.layout import DATA_DIR, index_file
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tensor import _torch_compat as tc
from shardkeeper.core.tensor.chunks import LocalLayout, replica_writer

#: A described leaf: its mesh, its placements in the rule's terms and the replica that writes.
Described = tuple[Mesh, tuple[tuple[Any, ...], ...], int]


def describe_leaf(key: str, t: torch.Tensor, layout: LocalLayout, meshes: dict[int, Mesh]) -> Described | None:
    """The rule of DTensor ``t`` (``layout``: this rank's pieces of it), or None when it has
    no rule (another placement) or this rank's pieces are not the rule's box. ``meshes``
    caches each DeviceMesh's ranks by identity."""
    rules = tuple(tc.placement_rule(p) for p in t.placements)  # type: ignore[attr-defined]
    if any(r is None for r in rules):
        return None
    dm = t.device_mesh  # type: ignore[attr-defined]
    mesh = meshes.get(id(dm))
    if mesh is None:
        mesh = meshes[id(dm)] = Mesh(*tc.mesh_ranks(dm))
    placements: tuple[tuple[Any, ...], ...] = tuple(r for r in rules if r is not None)
    coord = dm.get_coordinate()
    if coord is not None:
        offs, box = cell_box(tuple(t.shape), mesh, placements, coord)
        expect = [] if 0 in box else [(offs, box)]
        if [(p.offsets, p.shape) for p in layout.pieces] != expect:
            return None
    return mesh, placements, replica_writer(key, replicas(mesh, placements))


def choose(candidates: dict[str, Described], world_size: int, describe: bool | None) -> dict[str, Described]:
    """The leaves a save describes: all candidates (``describe`` True), none (False), or,
    by default, all once they would make at least ``TABLE_MIN_CHUNKS`` chunks."""
    if describe is False or not candidates:
        return {}
    if describe is None and len(candidates) * world_size < TABLE_MIN_CHUNKS:
        return {}
    return candidates


def described_digest(described: Mapping[str, Described]) -> str:
    """A digest of which leaves a rank describes and how: equal on every rank of a save."""
    mesh_ids: dict[int, str] = {}
    rows = []
    for key in sorted(described):
        mesh, placements, replica = described[key]
        mid = mesh_ids.get(id(mesh))
        if mid is None:
            mid = mesh_ids[id(mesh)] = xxhash.xxh3_64_hexdigest(json.dumps(mesh.to_json()).encode())
        rows.append([key, mid, [list(p) for p in placements], replica])
    return str(xxhash.xxh3_128_hexdigest(json.dumps(rows, separators=(",", ":")).encode()))


def split_report(
    chunks: dict[str, Any], described: Mapping[str, Described]
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
    rest = {"keys": keep_keys, "counts": keep_counts, "table": table.take(keep_rows)}
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
) -> tuple[str, int, str, list[list[Any]]]:
    """Write a rank's index file durably: its path, size, digest and the chunk files it names
    with the end of the last byte it references in each."""
    rel = index_file(rank, attempt)
    ends: dict[str, int] = {}
    for f, o, n in zip(table.file, table.offset, table.length):
        p = table.paths[f]
        ends[p] = max(ends.get(p, 0), o + n)
    files = [[p, ends[p]] for p in sorted(ends)]
    data = encode_index(step, rank, keys, table)
    writer = storage.open_writer(f"{step_dir}/{rel}")
    try:
        writer.write(data)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    storage.sync_dir(f"{step_dir}/{DATA_DIR}")
    return rel, len(data), digest_function(algorithm)(data), files


__all__ = ["Described", "choose", "describe_leaf", "described_digest", "split_report", "write_index"]
