"""The coordinator's half of the commit: many ranks' reports become one manifest, or an error.

Torch-free and pure: it checks that every rank declared the same dtype and global shape for
each tensor leaf and that the chunks tile each global shape exactly, then builds the
``Manifest``. The caller writes it with put-if-absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import accumulate, chain
from typing import Any

import xxhash

from shardkeeper.core.commit.tiling import covering_reports, tiling_problems
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.columns import (
    DIGEST_HEX,
    TABLE_MIN_CHUNKS,
    ChunkTable,
    no_gc,
)
from shardkeeper.core.format.described import DescribedLeaves
from shardkeeper.core.format.leaf_table import LeafTable
from shardkeeper.core.format.leaves import LazyLeaves
from shardkeeper.core.format.logical_member import combine_reports
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.reports import decode_report
from shardkeeper.core.format.table import TableLeaves


def declared_digest(declared: Mapping[str, Any]) -> str:
    """A digest of a rank's declarations of replicated and sharded leaves (key -> [kind, dtype,
    global shape]): ranks send this instead of the table, and the coordinator compares it
    with its own. Same state on every rank, same digest."""
    text = json.dumps(sorted(declared.items()), separators=(",", ":"))
    return str(xxhash.xxh3_128_hexdigest(text.encode()))


def assemble_manifest(
    step: int,
    attempt: str,
    reports: Sequence[Mapping[str, Any]],
    *,
    world_size: int,
    digest: str,
    block_bytes: int,
    metadata: Mapping[str, Any],
    described: Mapping[str, Any] | None = None,
    pages: Sequence[tuple[int, int, Sequence[Any]]] = (),
) -> Manifest:
    """Merge the ranks' reports (see ``docs/protocol.md``) into a manifest, or raise.

    ``reports[0]`` is the coordinator's own and declares every leaf it holds (``declared``:
    key -> [kind, dtype, global shape]); other ranks send ``declared_digest`` of their shared
    declarations plus ``declared`` for their per-rank keys only. Each report carries its
    ``chunks`` (key -> chunk records as JSON, or their columnar ``encode_report`` form),
    ``files``, ``objects``, ``per_rank_prefixes`` and ``layouts``. ``described``: the
    coordinator's described leaves (key -> ``format.grid.Rule``, save/describe.py),
    whose chunks the ranks' index files hold (their reports' ``described``). ``pages``: a
    group commit's (first rank, count, ``[path, size, digest, files, bytes]``) per group,
    whose pages hold every rank's index entry and chunk files instead (format.md 3.9);
    a report then stands for the ranks its ``ranks`` runs name.
    """
    with no_gc():
        return _assemble(step, attempt, reports, world_size, digest, block_bytes, metadata, described or {}, pages)


@dataclass
class _Gathered:
    """What the ranks' reports hold, gathered rank after rank (``_gather``)."""

    declared: dict[str, list[Any]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    prefixes: list[str] = field(default_factory=list)
    layouts: set[str] = field(default_factory=set)
    tables: list[ChunkTable] = field(default_factory=list)
    reported: list[tuple[list[str], list[int]]] = field(default_factory=list)  # per rank: its keys, row counts


def _assemble(
    step: int,
    attempt: str,
    reports: Sequence[Mapping[str, Any]],
    world_size: int,
    digest: str,
    block_bytes: int,
    metadata: Mapping[str, Any],
    described: Mapping[str, Any],
    pages: Sequence[tuple[int, int, Sequence[Any]]],
) -> Manifest:
    problems: list[str] = []
    ref = reports[0].get("declared_digest")
    differing = [x for r in reports[1:] if "declared_digest" in r and r["declared_digest"] != ref for x in _ranks(r)]
    if differing:
        problems.append(
            f"ranks {differing} hold states whose keys, dtypes or shapes differ from rank {reports[0]['rank']}'s"
        )
    width = DIGEST_HEX.get(digest, 0)
    got = _gather(reports, width, problems)
    declared = got.declared
    # Every rank's rows in one table (rank after rank); each leaf lists its rows.
    table = ChunkTable.concat(got.tables, width)
    bases = list(accumulate([len(t) for t in got.tables], initial=0))
    rows_of = _rows_by_key(bases, got.reported)
    if described or any(r.get("described") for r in reports):
        problems.extend(_described_problems(reports, described, declared, rows_of))
    # The leaves as columns, in key order (the leaf table's form, format.md 3.7).
    keys = sorted(declared.keys() - described.keys())
    decls = [declared[k] for k in keys]
    rows_list = [rows_of.get(k, []) for k in keys]
    dropped = tiling_problems(keys, decls, rows_list, table, problems)
    unknown = sorted(rows_of.keys() - declared.keys())
    if unknown:
        problems.append(f"chunks of undeclared keys {unknown[:3]}")
    both = sorted(declared.keys() & got.objects.keys())
    if both:
        problems.append(f"keys {both[:3]} are tensors on some ranks and JSON values on others")
    logical = None
    try:
        counted = {k: covering_reports(rows_of[k], table, bases) for k in dropped}
        logical = combine_reports(reports, declared, described, counted) if not problems else None
    except ValueError as e:
        problems.append(f"the logical digests cannot be combined: {e}")
    if problems:
        raise _not_one_checkpoint(step, problems)
    object_leaves = {k: {"kind": "object", "value": got.objects[k]} for k in sorted(got.objects)}
    if len(table) >= TABLE_MIN_CHUNKS or described:
        table.digest_text()
        why = table.problem(block_bytes)
        if why is not None:  # what every reader would refuse: never commit it
            raise StateMismatchError(f"step {step}: the ranks' chunk records are inconsistent: {why}")
        dl = None
        if described:
            dl = DescribedLeaves(_described_json(described, declared, reports, world_size, pages), width, block_bytes)
        out: Mapping[str, Any] = TableLeaves(object_leaves, _leaf_table(keys, decls, rows_list), table, block_bytes, dl)
    else:  # the per-chunk form: small manifests stay easy to read by eye
        out = _chunk_leaves(keys, decls, rows_list, table, block_bytes, object_leaves)
    return Manifest(
        step=step,
        world_size=world_size,
        leaves=out,
        files=dict(sorted(got.files.items())),
        digest_algorithm=digest,
        digest_block_bytes=block_bytes,
        per_rank_prefixes=tuple(got.prefixes),
        metadata={**metadata, "world_size": world_size, "layouts": sorted(got.layouts)},
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        attempt=attempt,
        logical=logical,
    )


def _gather(reports: Sequence[Mapping[str, Any]], width: int, problems: list[str]) -> _Gathered:
    """Every report's declarations (adding a problem where two ranks declare a key otherwise),
    chunk table, files, objects, per-rank prefixes and layouts."""
    got = _Gathered()
    owner: dict[str, int] = {}
    for r in reports:
        rank = r["rank"]
        for key, decl in r.get("declared", {}).items():
            prev = got.declared.setdefault(key, decl)
            if prev != decl:
                problems.append(
                    f"{key}: rank {owner[key]} has {prev[1]} {prev[2]}, rank {rank} has {decl[1]} {decl[2]}"
                )
            owner.setdefault(key, rank)
        table, keys, counts = decode_report(r["chunks"], width)
        if len(keys) != len(counts) or sum(counts) != len(table):
            problems.append(
                f"rank {rank}'s report lists {sum(counts)} chunks for {len(keys)} keys in a table of {len(table)} rows"
            )
        got.tables.append(table)
        got.reported.append((keys, counts))
        got.files.update(r["files"])
        for key, val in r["objects"].items():
            got.objects.setdefault(key, val)
        got.layouts.update(r.get("layouts", ()))
        for p in r["per_rank_prefixes"]:
            if p not in got.prefixes:
                got.prefixes.append(p)
    return got


def _not_one_checkpoint(step: int, problems: list[str]) -> StateMismatchError:
    return StateMismatchError(
        f"step {step}: the ranks' states do not form one checkpoint: "
        + "; ".join(problems[:5])
        + ("; ..." if len(problems) > 5 else "")
        + ". Every rank must pass the same keys; plain tensors are treated as replicated "
        "(wrap per-rank tensors in PerRank)"
    )


def _chunk_leaves(
    keys: list[str],
    decls: list[list[Any]],
    rows_list: list[list[int]],
    table: ChunkTable,
    block_bytes: int,
    object_leaves: dict[str, Any],
) -> LazyLeaves:
    """Every leaf with its chunk records, in key order (the per-chunk form)."""
    leaves: dict[str, Any] = {
        key: {
            "kind": d[0],
            "dtype": d[1],
            "shape": d[2],
            "chunks": [table.record_json(i, block_bytes) for i in rows],
        }
        for key, d, rows in zip(keys, decls, rows_list)
    }
    return LazyLeaves(dict(sorted({**leaves, **object_leaves}.items())))


def _leaf_table(keys: list[str], decls: list[list[Any]], rows_list: list[list[int]]) -> LeafTable:
    """The tensor leaves as the leaf table's columns (format.md 3.7)."""
    shapes = [d[2] for d in decls]
    return LeafTable(
        keys,
        [d[0] for d in decls],
        [d[1] for d in decls],
        list(map(len, shapes)),
        list(chain.from_iterable(shapes)),
        list(map(len, rows_list)),
        list(chain.from_iterable(rows_list)),
    )


def _described_problems(
    reports: Sequence[Mapping[str, Any]],
    described: Mapping[str, Any],
    declared: Mapping[str, Any],
    rows_of: Mapping[str, Any],
) -> list[str]:
    """What keeps the ranks' described leaves from one manifest: ranks that describe other
    leaves (or describe them otherwise) than the coordinator, and described leaves that are
    not tensors every rank declared, or that a rank also reported as enumerated chunks."""
    ref = reports[0].get("described", {}).get("digest")
    differing = [x for r in reports if r.get("described", {}).get("digest") != ref for x in _ranks(r)]
    out = []
    if differing:
        out.append(
            f"ranks {differing[:8]} record other leaves by their layout rule than rank {reports[0]['rank']} "
            f"(a DTensor of one key on other meshes, or holding shards other than its placements give; a "
            f"ShardedTensor whose shard is not its rank-order chunk; a Fragment whose partition= is not the "
            f"same on every rank, or whose elements are not its rank's part of it); correct partition=, or "
            f"pass describe_layouts=False"
        )
    odd = sorted(k for k in described if declared.get(k, [""])[0] != "tensor" or k in rows_of)
    if odd:
        out.append(f"described leaves {odd[:3]} are not tensors recorded by their rule alone")
    return out


def _described_json(
    described: Mapping[str, Any],
    declared: Mapping[str, Any],
    reports: Sequence[Mapping[str, Any]],
    world_size: int,
    pages: Sequence[tuple[int, int, Sequence[Any]]],
) -> dict[str, Any]:
    """The manifest's ``described`` member (format.md 3.8) from the coordinator's described
    leaves (key -> ``format.grid.Rule``) and every rank's index file, or the pages (3.9)."""
    meshes: list[Any] = []
    mesh_at: dict[Any, int] = {}
    layouts: list[Any] = []
    layout_at: dict[Any, int] = {}
    keys = sorted(described)
    layout_col, replica_col, shape = [], [], []
    for key in keys:
        rule = described[key]
        m = mesh_at.get(id(rule.mesh))
        if m is None:
            m = mesh_at[id(rule.mesh)] = len(meshes)
            meshes.append(rule.mesh.to_json(compact=bool(pages)))
        spec = rule.spec(m)
        li = layout_at.get(str(spec))
        if li is None:
            li = layout_at[str(spec)] = len(layouts)
            layouts.append(spec)
        layout_col.append(li)
        replica_col.append(rule.replica)
        shape.extend(declared[key][2])
    n = 0 if pages else world_size  # with pages, every rank's entry is in its group's page
    index_path: list[Any] = [None] * n
    index_size, index_digest = [0] * n, [""] * n
    chunk_files: dict[str, int] = {}
    for r in reports:
        d = r.get("described") or {}
        entry = d.get("index")
        if entry is not None:
            index_path[r["rank"]], index_size[r["rank"]], index_digest[r["rank"]] = entry
        for rel, end in d.get("chunk_files", ()):
            chunk_files[rel] = max(chunk_files.get(rel, 0), end)
    paths = sorted(chunk_files)
    return {
        "keys": keys,
        "kind": [declared[k][0] for k in keys],
        "dtype": [declared[k][1] for k in keys],
        "ndim": [len(declared[k][2]) for k in keys],
        "shape": shape,
        "layout": layout_col,
        "replica": replica_col,
        "layouts": layouts,
        "meshes": meshes,
        "index": {"path": index_path, "size": index_size, "digest": index_digest},
        "chunk_files": {"path": paths, "end": [chunk_files[p] for p in paths]},
        **({"pages": _pages_json(pages)} if pages else {}),
    }


def _pages_json(pages: Sequence[tuple[int, int, Sequence[Any]]]) -> dict[str, list[Any]]:
    """The ``pages`` columns (format.md 3.9), in rank order."""
    rows = sorted(pages, key=lambda p: p[0])
    entries = [e for _, _, e in rows]
    return {
        "path": [e[0] for e in entries],
        "size": [e[1] for e in entries],
        "digest": [e[2] for e in entries],
        "first": [first for first, _, _ in rows],
        "count": [count for _, count, _ in rows],
        "files": [e[3] for e in entries],
        "bytes": [e[4] for e in entries],
    }


def _ranks(report: Mapping[str, Any]) -> list[int]:
    """The ranks a report stands for (a group leader folds equal ones: their ``ranks`` runs)."""
    runs = report.get("ranks")
    return [r for a, b in runs for r in range(a, b + 1)] if runs else [report["rank"]]


def _rows_by_key(bases: Sequence[int], reported: Sequence[tuple[list[str], list[int]]]) -> dict[str, list[int]]:
    """Each key's rows in the concatenated table (rank after rank; ``bases``: each rank's
    first row). When every rank reports one chunk of each of the same keys (FSDP, row
    sharding), the rows are columns of a grid, built without a per-chunk Python loop."""
    keys0 = reported[0][0] if reported else []
    if all(keys == keys0 and counts.count(1) == len(counts) for keys, counts in reported):
        n = len(keys0)
        return dict(zip(keys0, map(list, zip(*[range(b, b + n) for b in bases[: len(reported)]]))))
    rows_of: dict[str, list[int]] = {}
    for base, (keys, counts) in zip(bases, reported):
        for key, start, count in zip(keys, accumulate(counts, initial=base), counts):
            rows = rows_of.get(key)
            if rows is None:
                rows_of[key] = rows = []
            rows.extend(range(start, start + count))
    return rows_of


__all__ = ["assemble_manifest", "declared_digest"]
