"""The coordinator's half of the commit: many ranks' reports become one manifest, or an error.

Torch-free and pure: it checks that every rank declared the same dtype and global shape for
each tensor leaf and that the chunks tile each global shape exactly, then builds the
``Manifest``. The caller writes it with put-if-absent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.manifest import (
    FORMAT_VERSION,
    ChunkRecord,
    LeafRecord,
    Manifest,
    check_tiling,
)


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
    """Merge the ranks' reports (see ``docs/protocol.md``) into a validated manifest.

    A report: ``declared`` (key -> [kind, dtype, global shape]), ``chunks`` (key -> chunk
    records as JSON), ``files``, ``objects``, ``per_rank_prefixes``, ``layouts``.
    """
    declared: dict[str, tuple[int, list[Any]]] = {}
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkRecord]] = {}
    files: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    prefixes: list[str] = []
    layouts: set[str] = set()
    problems: list[str] = []
    for r in reports:
        rank = r["rank"]
        for key, decl in r["declared"].items():
            prev = declared.setdefault(key, (rank, decl))
            if prev[1] != decl:
                problems.append(
                    f"{key}: rank {prev[0]} has {prev[1][1]} {prev[1][2]}, rank {rank} has {decl[1]} {decl[2]}"
                )
        for key, recs in r["chunks"].items():
            boxes = chunks.setdefault(key, {})
            for c in recs:
                rec = ChunkRecord.from_json(c)
                boxes.setdefault((rec.offsets, rec.shape), rec)  # a replica written twice counts once
        files.update(r["files"])
        for key, val in r["objects"].items():
            objects.setdefault(key, val)
        layouts.update(r.get("layouts", ()))
        for p in r["per_rank_prefixes"]:
            if p not in prefixes:
                prefixes.append(p)
    leaves: dict[str, LeafRecord] = {}
    for key, (_, (kind, dtype, shape)) in declared.items():
        recs = tuple(chunks.get(key, {}).values())
        why = check_tiling(key, tuple(shape), recs)
        if why is not None:
            problems.append(f"{key}: {why}")
        leaves[key] = LeafRecord(kind=kind, dtype=dtype, shape=tuple(shape), chunks=recs)
    for key, val in objects.items():
        leaves[key] = LeafRecord(kind="object", value=val)
    if problems:
        raise StateMismatchError(
            f"step {step}: the ranks' states do not form one checkpoint: "
            + "; ".join(problems[:5])
            + ("; ..." if len(problems) > 5 else "")
            + ". Every rank must pass the same keys; plain tensors are treated as replicated "
            "(wrap per-rank tensors in PerRank)"
        )
    return Manifest(
        step=step,
        world_size=world_size,
        leaves=dict(sorted(leaves.items())),
        files=dict(sorted(files.items())),
        digest_algorithm=digest,
        digest_block_bytes=block_bytes,
        per_rank_prefixes=tuple(prefixes),
        metadata={**metadata, "world_size": world_size, "layouts": sorted(layouts)},
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        attempt=attempt,
        format_version=FORMAT_VERSION,
    )
