"""The coordinator's half of the commit: many ranks' reports become one manifest, or an error.

Torch-free and pure: it checks that every rank declared the same dtype and global shape for
each tensor leaf and that the chunks tile each global shape exactly, then builds the
``Manifest``. The caller writes it with put-if-absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from itertools import accumulate
from typing import Any

import xxhash

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.manifest import DTYPES, FORMAT_VERSION, LazyLeaves, Manifest
from shardkeeper.core.format.table import (
    DIGEST_HEX,
    TABLE_MIN_CHUNKS,
    ChunkTable,
    TableLeaves,
    all_slabs,
    decode_report,
    leaf_chunks_problem,
    no_gc,
)


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
) -> Manifest:
    """Merge the ranks' reports (see ``docs/protocol.md``) into a manifest, or raise.

    ``reports[0]`` is the coordinator's own and declares every leaf it holds (``declared``:
    key -> [kind, dtype, global shape]); other ranks send ``declared_digest`` of their shared
    declarations plus ``declared`` for their per-rank keys only. Each report carries its
    ``chunks`` (key -> chunk records as JSON, or their columnar ``encode_report`` form),
    ``files``, ``objects``, ``per_rank_prefixes`` and ``layouts``.
    """
    with no_gc():
        return _assemble(step, attempt, reports, world_size, digest, block_bytes, metadata)


def _assemble(
    step: int, attempt: str, reports: Sequence[Mapping[str, Any]], world_size: int, digest: str,
    block_bytes: int, metadata: Mapping[str, Any],
) -> Manifest:
    problems: list[str] = []
    declared: dict[str, list[Any]] = {}
    owner: dict[str, int] = {}
    ref = reports[0].get("declared_digest")
    differing = [r["rank"] for r in reports[1:] if "declared_digest" in r and r["declared_digest"] != ref]
    if differing:
        problems.append(
            f"ranks {differing} hold states whose keys, dtypes or shapes differ from rank "
            f"{reports[0]['rank']}'s"
        )
    files: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    prefixes: list[str] = []
    layouts: set[str] = set()
    width = DIGEST_HEX.get(digest, 0)
    tables: list[ChunkTable] = []
    reported: list[tuple[list[str], list[int]]] = []  # per rank: its keys and their row counts
    for r in reports:
        rank = r["rank"]
        for key, decl in r.get("declared", {}).items():
            prev = declared.setdefault(key, decl)
            if prev != decl:
                problems.append(f"{key}: rank {owner[key]} has {prev[1]} {prev[2]}, rank {rank} has {decl[1]} {decl[2]}")
            owner.setdefault(key, rank)
        table, keys, counts = decode_report(r["chunks"], width)
        if len(keys) != len(counts) or sum(counts) != len(table):
            problems.append(f"rank {rank}'s report lists {sum(counts)} chunks for {len(keys)} keys in a table of {len(table)} rows")
        tables.append(table)
        reported.append((keys, counts))
        files.update(r["files"])
        for key, val in r["objects"].items():
            objects.setdefault(key, val)
        layouts.update(r.get("layouts", ()))
        for p in r["per_rank_prefixes"]:
            if p not in prefixes:
                prefixes.append(p)
    # Every rank's rows in one table (rank after rank); each leaf lists its rows.
    table = ChunkTable.concat(tables, width)
    bases = list(accumulate([len(t) for t in tables], initial=0))
    leaves: dict[str, Any] = {}
    raw_only = "encoding" not in table.extras  # encoded chunks' lengths are their own
    items = []
    rows_of = _rows_by_key(bases, reported)
    for key in sorted(declared):
        kind, dtype, shape = declared[key]
        rows = rows_of.get(key, [])
        leaves[key] = {"kind": kind, "dtype": dtype, "shape": shape, "rows": rows}
        items.append((key, shape, DTYPES[dtype][1] if dtype in DTYPES else 1, rows))
    shapes, iszs, counts, perm = [it[1] for it in items], [it[2] for it in items], [len(it[3]) for it in items], []
    for it in items:
        perm.extend(it[3])
    if not all_slabs(shapes, iszs, counts, perm, table, check_lengths=raw_only):
        for key, shape, isz, rows in items:
            why = leaf_chunks_problem(key, shape, isz, rows, table, check_lengths=raw_only)
            if why is not None and len(rows) > 1:
                # A replica written by more than one rank counts once.
                unique = list({table.box(i): i for i in rows}.values())
                if len(unique) < len(rows):
                    leaves[key]["rows"] = rows = sorted(unique)
                    why = leaf_chunks_problem(key, shape, isz, rows, table, check_lengths=raw_only)
            if why is not None:
                problems.append(f"{key}: {why}")
    unknown = sorted(rows_of.keys() - declared.keys())
    if unknown:
        problems.append(f"chunks of undeclared keys {unknown[:3]}")
    for key in sorted(objects):
        leaves[key] = {"kind": "object", "value": objects[key]}
    if problems:
        raise StateMismatchError(
            f"step {step}: the ranks' states do not form one checkpoint: "
            + "; ".join(problems[:5])
            + ("; ..." if len(problems) > 5 else "")
            + ". Every rank must pass the same keys; plain tensors are treated as replicated "
            "(wrap per-rank tensors in PerRank)"
        )
    if len(table) >= TABLE_MIN_CHUNKS:
        table.digest_text()
        why = table.problem(block_bytes)
        if why is not None:  # what every reader would refuse: never commit it
            raise StateMismatchError(f"step {step}: the ranks' chunk records are inconsistent: {why}")
        out: Mapping[str, Any] = TableLeaves.from_raw(dict(sorted(leaves.items())), table, block_bytes)
    else:  # the per-chunk form: small manifests stay easy to read by eye
        for leaf in leaves.values():
            if "rows" in leaf:
                leaf["chunks"] = [table.record_json(i, block_bytes) for i in leaf.pop("rows")]
        out = LazyLeaves(dict(sorted(leaves.items())))
    return Manifest(
        step=step,
        world_size=world_size,
        leaves=out,
        files=dict(sorted(files.items())),
        digest_algorithm=digest,
        digest_block_bytes=block_bytes,
        per_rank_prefixes=tuple(prefixes),
        metadata={**metadata, "world_size": world_size, "layouts": sorted(layouts)},
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        attempt=attempt,
        format_version=FORMAT_VERSION,
    )



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
