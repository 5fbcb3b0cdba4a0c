"""Quarantine: a step that a restore found damaged stops holding its step, its bytes kept to be looked at.

A restore of the newest step falls back past a damaged step, but the step stays committed, so
the loop's next save of it (``start = mgr.restore(state) + 1``) is refused, on every restart.
So the restore's coordinator quarantines each damaged step it fell back past
(``restore/quarantine.py``):

- **Verified** as ``delete --damaged`` verifies (``delete_damaged.judge_damaged``), limited to
  the manifest, its pages and index files and the files the ranks' errors named: only damage
  proven on the stored bytes counts (a digest that differs, a missing or short file, a manifest
  that does not validate). A storage error, a file sealed under a key the provider does not
  hold, a manifest bound to another root, or bytes that now verify intact prove none: nothing
  is done.
- **Moved aside** as a deletion starts (retention, ``delete()``): the manifest goes first, so a
  commit that would reference the step fails its check of its bases (``commit/intents.py``). Its
  exact bytes are first put, put-if-absent, at ``<step dir>/quarantined-<digest>.manifest.json``
  (the digest of those bytes: two restores quarantining one step put the same name), and the
  manifest is removed only if it still holds the bytes that were verified (another writer's
  manifest of the step, committed meanwhile, is left alone).
- **Kept until gc.** The step's files stay where they are; ``shardkeeper verify ROOT STEP
  --quarantined`` and ``inspect ROOT STEP --quarantined`` read them through the copy, ``ls``
  shows the step as ``quarantined`` until it is saved again, and ``shardkeeper gc`` removes them
  by its rules (nothing commits them: leftovers, removed once older than ``min_age_s``, the copy
  with them). The step is not committed any more, so a save of it commits.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import xxhash

from shardkeeper.core.commit.catalog import forget_deleted
from shardkeeper.core.commit.committed import attach_index_files, manifest_path
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
)
from shardkeeper.core.format import manifest as manifest_format
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage.base import Storage

PREFIX = "quarantined-"
SUFFIX = ".manifest.json"
#: Files a restore's error names per damaged step and rank (it stops at the first damaged chunk).
MAX_NAMED = 16


@dataclass
class Quarantined:
    """What ``quarantine_damaged`` found (``damage``: the first problems) and where the
    manifest went (``path``, root-relative)."""

    step: int
    path: str
    damage: list[str] = field(default_factory=list)


def quarantine_name(step: int, data: bytes) -> str:
    """Root-relative: where ``step``'s manifest of bytes ``data`` goes when quarantined."""
    return f"{step_dir(step)}/{PREFIX}{xxhash.xxh3_64_hexdigest(data)}{SUFFIX}"


def is_quarantined(name: str) -> bool:
    """Whether an entry of a step directory is a quarantined manifest."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return base.startswith(PREFIX) and base.endswith(SUFFIX)


def named_files(error: BaseException | None) -> list[str]:
    """The files a restore's error (or one in its chain of causes) names as damaged: a digest
    that differs, a missing or short file (``CorruptCheckpointError.file``)."""
    out: list[str] = []
    seen: set[int] = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        path = getattr(e, "file", "")
        if isinstance(e, CorruptCheckpointError) and isinstance(path, str) and path and path not in out:
            out.append(path)
        e = e.__cause__ or e.__context__
    return out[:MAX_NAMED]


def quarantine_damaged(
    storage: Storage,
    step: int,
    *,
    read_storage: Storage | None = None,
    files: Collection[str] | None = None,
    catalog: str | None = None,
) -> Quarantined:
    """Verify ``step`` (``judge_damaged``, limited to ``files`` when given) and, when it is
    damaged, move its manifest aside (see the module). Raises as ``judge_damaged`` with
    nothing done, and ``ValueError`` when the manifest changed meanwhile or its copy cannot be
    put; a storage error propagates (the manifest stays, or its copy is there as well)."""
    path = manifest_path(step)
    where = f"step {step} under {storage.url}"
    if storage.size(path) > manifest_format.MAX_MANIFEST_BYTES:
        raise ValueError(
            f"{where}: its manifest is larger than any a reader accepts, so it is not copied aside: nothing was "
            f"quarantined. `shardkeeper delete {storage.url} {step} --damaged` deletes the step"
        )
    from shardkeeper.core.lifecycle.delete_damaged import judge_damaged  # numpy (the chunk reader)

    before = storage.read_bytes(path)
    found = judge_damaged(storage, step, read_storage=read_storage, files=files, verb="quarantined")
    aside = quarantine_name(step, before)
    try:
        storage.put_if_absent(aside, before)
    except CommitConflictError:  # another restore quarantined these very bytes: the same name
        if storage.read_bytes(aside) != before:
            raise ValueError(
                f"{where}: {storage.describe(aside)} exists and holds other bytes than the damaged manifest; "
                f"nothing was quarantined"
            ) from None
    if storage.read_bytes(path) != before:  # (a storage error here leaves both: the copy is gc's)
        raise ValueError(
            f"{where}: its manifest changed while it was verified (another writer deleted and saved the step "
            f"again); the new one is left alone: nothing was quarantined"
        )
    storage.delete(path)  # the step stops being committed; its files stay for gc
    forget_deleted(catalog, storage, [step])
    return Quarantined(step, aside, found.damage)


def quarantined_manifests(storage: Storage, step: int) -> list[str]:
    """The quarantined manifests of ``step`` (root-relative), oldest first (by the storage's
    times; ``[]`` when the step has no directory)."""
    try:
        names = storage.list_dir(step_dir(step))
    except CheckpointError:
        return []
    paths = [f"{step_dir(step)}/{n.rstrip('/').rsplit('/', 1)[-1]}" for n in names if is_quarantined(n)]
    return sorted(paths, key=lambda p: (_mtime(storage, p), p))


def load_quarantined(storage: Storage, step: int) -> tuple[str, Manifest]:
    """The newest quarantined manifest of ``step`` and where it is, validated as a manifest
    (not authenticated: a copy, put aside because it was damaged). Raises
    ``CheckpointNotFoundError`` when the step has none, ``CorruptCheckpointError`` when it does
    not validate."""
    paths = quarantined_manifests(storage, step)
    if not paths:
        raise CheckpointNotFoundError(
            f"step {step} under {storage.url} has no quarantined manifest ({storage.describe(step_dir(step))}/"
            f"{PREFIX}*{SUFFIX}): a restore quarantines a damaged step it falls back past, and gc removes it"
        )
    path = paths[-1]
    if storage.size(path) > manifest_format.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(manifest_format.too_large(storage.describe(path), storage.size(path)))
    m = Manifest.loads(storage.read_bytes(path), where=storage.describe(path))
    if m.step != step:
        raise CorruptCheckpointError(f"quarantined manifest {storage.describe(path)} says step {m.step}, not {step}")
    attach_index_files(storage, m)
    return path, m


def _mtime(storage: Storage, path: str) -> float:
    try:
        return storage.mtime(path)
    except CheckpointError:
        return 0.0


__all__ = [
    "MAX_NAMED",
    "PREFIX",
    "Quarantined",
    "SUFFIX",
    "is_quarantined",
    "load_quarantined",
    "named_files",
    "quarantine_damaged",
    "quarantine_name",
    "quarantined_manifests",
]
