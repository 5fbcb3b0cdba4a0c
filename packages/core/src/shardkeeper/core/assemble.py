"""The coordinator's half of the commit: many ranks' reports become one manifest, or an error.

Torch-free and pure: it checks that every rank declared the same dtype and global shape for
each tensor leaf and that the chunks tile each global shape exactly, then builds the
``Manifest``. The caller writes it with put-if-absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import xxhash

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.manifest import (
    FORMAT_VERSION,
    LazyLeaves,
    Manifest,
    check_tiling_boxes,
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
    ``chunks`` (key -> chunk records as JSON, passed through to the manifest unchanged),
    ``files``, ``objects``, ``per_rank_prefixes`` and ``layouts``.
    """
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
    chunks: dict[str, list[dict[str, Any]]] = {}
    files: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    prefixes: list[str] = []
    layouts: set[str] = set()
    for r in reports:
        rank = r["rank"]
        for key, decl in r.get("declared", {}).items():
            prev = declared.setdefault(key, decl)
            if prev != decl:
                problems.append(f"{key}: rank {owner[key]} has {prev[1]} {prev[2]}, rank {rank} has {decl[1]} {decl[2]}")
            owner.setdefault(key, rank)
        for key, recs in r["chunks"].items():
            have = chunks.get(key)
            if have is None:
                chunks[key] = list(recs)
            else:
                have.extend(recs)
        files.update(r["files"])
        for key, val in r["objects"].items():
            objects.setdefault(key, val)
        layouts.update(r.get("layouts", ()))
        for p in r["per_rank_prefixes"]:
            if p not in prefixes:
                prefixes.append(p)
    leaves: dict[str, Any] = {}
    for key in sorted(declared):
        kind, dtype, shape = declared[key]
        recs = chunks.get(key, [])
        why = check_tiling_boxes(key, shape, [(c["offsets"], c["shape"]) for c in recs])
        if why is not None and len(recs) > 1:
            # A replica written by more than one rank counts once.
            unique = list({(tuple(c["offsets"]), tuple(c["shape"])): c for c in recs}.values())
            if len(unique) < len(recs):
                recs = unique
                why = check_tiling_boxes(key, shape, [(c["offsets"], c["shape"]) for c in recs])
        if why is not None:
            problems.append(f"{key}: {why}")
        leaves[key] = {"kind": kind, "dtype": dtype, "shape": shape, "chunks": recs}
    unknown = sorted(set(chunks) - set(declared))
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
    return Manifest(
        step=step,
        world_size=world_size,
        leaves=LazyLeaves(dict(sorted(leaves.items()))),
        files=dict(sorted(files.items())),
        digest_algorithm=digest,
        digest_block_bytes=block_bytes,
        per_rank_prefixes=tuple(prefixes),
        metadata={**metadata, "world_size": world_size, "layouts": sorted(layouts)},
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        attempt=attempt,
        format_version=FORMAT_VERSION,
    )
