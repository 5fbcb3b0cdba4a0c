"""The coordinator's last steps of a commit: announce, check, put.

``commit_manifest`` writes the intent of ``commit/intents.py``, then checks what the manifest relies
on (no gc claim on the step, every earlier step it references still committed, every file
there and large enough, the bytes read back by the reader exactly), puts the manifest with
put-if-absent within half the intent's lifetime, and removes the intent. Any failed check
fails the save: nothing is committed over missing or unreadable bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from shardkeeper.core.commit import intents as pending
from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointSaveError,
    CommitConflictError,
    CorruptCheckpointError,
)
from shardkeeper.core.format.jsonvalue import same_value
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage.base import Storage, size_or_missing, sizes_of

log = logging.getLogger(__name__)

#: Test seam: called right before the manifest's put, after every check (None in use).
_before_put: Any = None


def commit_manifest(
    storage: Storage,
    step: int,
    manifest: Manifest,
    data: bytes,
    *,
    bases: list[int],
    references: Mapping[str, int] | None = None,
    executor: Any = None,
    checked: Callable[[str], bool] | None = None,
) -> None:
    """Commit ``manifest`` (whose exact bytes are ``data``) as ``step``, or raise. ``bases``:
    the committed steps whose manifests the references of an incremental save came from;
    ``references``: files of earlier steps that the manifest's pages reference (relative to
    the step directory, with the end of the last byte; group commit), announced and checked
    with the manifest's own; ``executor``: where the files' sizes are asked for in parallel;
    ``checked``: which files (root-relative) this process can check, where others are checked
    on their own node (a local tier: no node sees another's disk); None: all."""
    ends = _file_ends(step, manifest)
    for rel, end in (references or {}).items():
        path = resolve_file(step, rel)
        if path is not None:
            ends[path] = max(ends.get(path, 0), end)
    intent = pending.write_intent(storage, step, manifest.attempt, ends)
    t0 = time.monotonic()
    try:
        _check_not_claimed(storage, step)
        _check_bases(storage, step, bases)
        _check_files(
            storage,
            step,
            manifest,
            ends if checked is None else {p: e for p, e in ends.items() if checked(p)},
            executor,
        )
        check_reads_back(storage, step, data, manifest)
        if _before_put is not None:
            _before_put(step)
        elapsed = time.monotonic() - t0
        if elapsed > pending.INTENT_TTL_S / 2:
            raise CheckpointSaveError(
                f"step {step}: the checks before the commit under {storage.url} took {elapsed:.0f} s, more than "
                f"half the {pending.INTENT_TTL_S:.0f} s a commit intent protects its files; nothing was "
                f"committed (the storage is very slow: retry the save)",
                step=step,
            )
        _put_if_absent(storage, step, data)
    finally:
        pending.remove(storage, intent)


def _file_ends(step: int, manifest: Manifest) -> dict[str, int]:
    """Every file the manifest references (root-relative) and the end of its last chunk; its
    own files with their recorded sizes."""
    ends: dict[str, int] = {}
    for rel, end in manifest.chunk_file_ends(pages=False).items():  # (leaders checked their pages' files)
        path = resolve_file(step, rel)
        if path is not None:
            ends[path] = max(ends.get(path, 0), end)
    for rel in manifest.files:
        path = resolve_file(step, rel)
        if path is not None:
            ends.setdefault(path, 0)
    return ends


def _check_not_claimed(storage: Storage, step: int) -> None:
    if step in pending.claimed_steps(storage):
        raise CheckpointSaveError(
            f"step {step}: a `shardkeeper gc` is removing the files of {storage.describe(step_dir(step))} "
            f"(it judged this save abandoned: its --min-age-s is shorter than this save took); nothing "
            f"was committed. Raise gc's --min-age-s above your slowest save, and save again",
            step=step,
        )


def _check_bases(storage: Storage, step: int, bases: list[int]) -> None:
    """An incremental save references files of earlier steps through a base step's manifest:
    that step must still be committed (a deleter removes a file only after the manifests
    that reference it, and reads the intents in between)."""
    for base in bases:
        if not storage.exists(manifest_path(base)):
            raise CheckpointSaveError(
                f"step {step}: it references files of step {base} under {storage.url} (an incremental save), "
                f"and step {base} was deleted while this save ran; nothing was committed. Save again: the "
                f"next save finds another base",
                step=step,
            )


def _check_files(storage: Storage, step: int, manifest: Manifest, ends: dict[str, int], executor: Any) -> None:
    """Every file is there, whole: this save's own files at the size its rank wrote (which
    catches what happened since they were closed: a gc that judged a slow save abandoned, a
    store that lost a part), referenced files at least to their last referenced byte."""
    own = {resolve_file(step, rel): info for rel, info in manifest.files.items()}
    check_files(storage, own, ends, executor)


def check_files(
    storage: Storage, own: Mapping[Any, Mapping[str, Any]], ends: Mapping[str, int], executor: Any = None
) -> None:
    """Every file of ``ends`` (root-relative path -> end of the last byte referenced) is there:
    one of ``own`` (path -> its record) at exactly the size its rank wrote, any other at least
    to its end. One stat or HEAD per file; on a remote storage in parallel on ``executor``
    (an object store's latency, not its throughput, bounds them), else in one batch
    (``sizes_of``: on local disk each directory opened once, one ``fstatat`` a file). Raises
    naming the first wrong file."""

    paths = list(ends)
    parallel = executor is not None and len(paths) > 1 and storage.capabilities.remote
    sizes = executor.map(partial(size_or_missing, storage), paths) if parallel else sizes_of(storage, paths)
    for path, size in zip(paths, sizes):
        end = ends[path]
        info = own.get(path)
        want = info["size_bytes"] if info is not None else end
        if (size != want) if info is not None else (size < want):
            who = f"written by rank {info.get('rank')}" if info is not None else "referenced from an earlier step"
            raise CorruptCheckpointError(
                f"{storage.describe(path)} ({who}) is {'missing' if size < 0 else f'{size} bytes'} at commit "
                f"time, {want} bytes {'were written' if info is not None else 'are needed'}; something removed "
                f"or truncated it (a `shardkeeper gc` with a --min-age-s shorter than a save?)"
            )


def check_reads_back(storage: Storage, step: int, data: bytes, manifest: Manifest) -> None:
    """Parse the exact bytes about to be committed with the reader, and compare every value a
    user supplied: a manifest that readers would refuse, or a value that would not come back
    exactly, fails the save instead of being acknowledged and never restorable."""
    where = storage.describe(manifest_path(step))
    try:
        back = Manifest.loads(data, where=f"{where} (before the commit)")
    except CheckpointError as e:
        raise CheckpointSaveError(
            f"step {step}: the manifest built for {where} is refused by the reader ({e}); nothing was committed",
            step=step,
        ) from e
    written, read = manifest.object_values(), back.object_values()
    for key, value in written.items():
        why = same_value(value, read.get(key))
        if why is not None:
            raise CheckpointSaveError(
                f"step {step}: the value of {key!r} would not come back exactly from {where} ({why}); "
                f"nothing was committed: store it in another form",
                step=step,
            )


def _put_if_absent(storage: Storage, step: int, data: bytes) -> None:
    """Put-if-absent; a conflict with our own bytes is our own write whose reply was lost (a
    retried PUT on an object store), so it counts as success."""
    path = manifest_path(step)
    try:
        storage.put_if_absent(path, data)
    except CommitConflictError:
        try:
            existing = storage.read_bytes(path)
        except CheckpointError:
            existing = b""
        if existing != data:
            raise
        log.info("step %d: the manifest was already ours (a retried write); committed", step)


__all__ = ["check_reads_back", "commit_manifest"]
