"""``shardkeeper ls ROOT --local DIR ...``: which tiers hold each step.

Each ``--local`` is one node's local directory (docs/tiers.md). A step is listed under
``persistent`` when it is committed under ROOT, under ``local:K`` for each directory K that
holds its manifest, and ``local_whole`` says whether the directories given, together, hold
every file its manifest lists at its size (None when no given directory's manifest can be
read here, e.g. an encrypted one); ``local_recoverable`` whether a step not whole there can
be rebuilt from the parity they hold (``erasure=(k, m)``; the directories given in node
order). Torch-free, like every command."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.core.cli.common import manifest_figures
from shardkeeper.core.commit.committed import load_manifest, manifest_digest, manifest_path, manifest_steps
from shardkeeper.core.commit.files import resolve_file, walk_files
from shardkeeper.core.errors import CheckpointError, UsageError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.placement import PARITY_DIR, listing, plan


def _sizes(storage: Storage, step: int) -> dict[str, int]:
    out = {}
    for path in walk_files(storage, step_dir(step)):
        try:
            out[path] = storage.size(path)
        except CheckpointError:
            continue
    return out


def _manifest(dirs: list[Storage], step: int, holders: list[int]) -> Manifest | None:
    """The first of the holders' manifests of ``step`` that validates here."""
    for k in holders:
        try:
            return load_manifest(dirs[k], step)
        except CheckpointError:
            continue
    return None


def _whole(m: Manifest | None, step: int, files: list[dict[str, int]]) -> bool | None:
    if m is None or m.encryption is not None:
        return None  # stored sizes are not the manifest's (encrypted files are larger): not judged here
    need = {resolve_file(step, rel): int(info["size_bytes"]) for rel, info in m.files.items()}
    return all(any(f.get(p) == n for f in files) for p, n in need.items() if p is not None)


def add_tiers(rows: list[dict[str, Any]], local_dirs: list[str]) -> None:
    """Give every row its ``tiers`` and ``local_whole``; add rows for steps only the local
    directories hold (status ``local``)."""
    for d in local_dirs:
        if not os.path.isdir(d):
            raise UsageError(f"--local {d}: no such directory (a node's local tier directory, docs/tiers.md)")
    dirs: list[Storage] = [LocalStorage(d) for d in local_dirs]
    steps = sorted({s for d in dirs for s in manifest_steps(d)} | {r["step"] for r in rows})
    by_step = {r["step"]: r for r in rows}
    parity = [listing(d, d) for d in dirs] if any(d.exists(PARITY_DIR) for d in dirs) else None
    for step in steps:
        row = by_step.get(step)
        if row is None:
            row = by_step[step] = {"step": step, "status": "local", "size_bytes": None, "leaves": None}
            row.update(logical_bytes=None, world_size=None, created_at=None, latest_hint=False)
            rows.append(row)
        holders = [k for k, d in enumerate(dirs) if d.exists(manifest_path(step))]
        row["tiers"] = (["persistent"] if row["status"] == "committed" else []) + [f"local:{k}" for k in holders]
        m = _manifest(dirs, step, holders)
        if m is not None and row["status"] == "local":  # a step only the local tier holds: its manifest's figures
            row.update(manifest_figures(m))
        files = [_sizes(d, step) for d in dirs] if holders else []
        row["local_whole"] = _whole(m, step, files) if holders else False
        row["local_recoverable"] = bool(holders and parity and not row["local_whole"] and plan(parity, step, len(dirs)))
        # different manifests of one step on two nodes: restore refuses the step (docs/tiers.md)
        row["local_conflict"] = len({manifest_digest(dirs[k], step) for k in holders}) > 1
    rows.sort(key=lambda r: r["step"])


def tiers_cell(row: dict[str, Any]) -> str:
    tiers = ",".join(row.get("tiers", [])) or "-"
    whole = row.get("local_whole")
    conflict = " (conflict)" if row.get("local_conflict") else ""
    if not any(t.startswith("local:") for t in row.get("tiers", [])):
        state = ""
    elif whole:
        state = " (whole)"
    elif row.get("local_recoverable"):
        state = " (recoverable)"  # from the parity of erasure=(k, m)
    else:
        state = " (partial)" if whole is False else " (?)"
    return tiers + state + conflict


__all__ = ["add_tiers", "tiers_cell"]
