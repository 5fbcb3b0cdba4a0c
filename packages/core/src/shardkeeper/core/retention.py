"""Retention (which committed checkpoints to keep) and garbage collection (what is left over).

Both are reference-aware at file level: a chunk of a checkpoint may live in a file of an
earlier step (``../step-XXXXXXXXXXXX/data/...``, incremental checkpoints), so a step's files
are deleted only when no manifest that stays committed references them.

Deletion order is what keeps a crash harmless: a step's manifest is deleted first, so it stops
being committed, and only then its data. A crash in between leaves an uncommitted directory,
which ``collect_garbage`` removes later; it never leaves a committed manifest pointing at
missing bytes.

Needs no torch: an operator runs this (``shardkeeper gc``) from any machine.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.commit import committed_steps, load_manifest, manifest_path, step_dirs
from shardkeeper.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    StorageError,
)
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)

#: Default minimum age of leftovers that ``collect_garbage`` removes: 15 minutes.
DEFAULT_GC_MIN_AGE_S = 900.0

# Names the format gives to files (never to directories): walk_files does not list them.
_FILE_SUFFIXES = (".safetensors", ".tmp", MANIFEST_NAME)

# How deep ``walk_files`` descends below a step directory (the layout uses one level: data/).
_MAX_DEPTH = 8


# --------------------------------------------------------------------------------------------
# Paths


def resolve_file(step: int, rel: str) -> str | None:
    """Root-relative path of a manifest ``file`` entry of ``step``, or None if it is invalid.

    ``rel`` is relative to the step directory and may climb into another step directory
    (``../step-000000001100/data/r00000-ab12cd34-000.safetensors``); a path that leaves the
    root, or is absolute, is invalid.
    """
    if not rel or rel.startswith("/") or "\\" in rel:
        return None
    path = posixpath.normpath(f"{step_dir(step)}/{rel}")
    if path in (".", "..") or path.startswith("../") or path.startswith("/"):
        return None
    return path


def referenced_paths(step: int, manifest: Manifest) -> set[str]:
    """Root-relative paths of every file ``manifest`` (of ``step``) lists or points a chunk at."""
    out = set()
    for rel in manifest.referenced_files():
        path = resolve_file(step, rel)
        if path is not None:
            out.add(path)
    return out


def _base(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def walk_files(storage: Storage, path: str, _depth: int = 0) -> list[str]:
    """Every file under the directory ``path`` (root-relative paths), sorted.

    The storage protocol has no "is a directory" call: names the format gives to files
    (``*.safetensors``, ``*.tmp``, ``manifest.json``) are files; any other entry with entries
    of its own is a directory, and one without is taken for a file (an empty POSIX directory
    is therefore listed too; deleting it falls back to ``delete_dir``). A local symbolic link
    lists as empty (``LocalStorage`` never lists through one), so it is an entry too, and
    deleting it deletes the link, never what it points at.
    """
    out: list[str] = []
    for raw in storage.list_dir(path):
        name = _base(raw)
        if not name or name in (".", ".."):
            continue
        child = f"{path}/{name}" if path else name
        if name.endswith(_FILE_SUFFIXES) or _depth >= _MAX_DEPTH:
            out.append(child)  # files by the format's naming: no listing (a request on S3)
            continue
        try:
            sub = storage.list_dir(child)
        except CorruptCheckpointError:
            sub = []  # cannot be listed for what it is (a symlink loop...): an entry, as a file
        # Some object-store listings return the object itself when asked to list a file.
        if sub and [_base(s) for s in sub] != [name]:
            out.extend(walk_files(storage, child, _depth + 1))
        else:
            out.append(child)
    return sorted(out)


def _remove_file(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except (StorageError, CorruptCheckpointError):  # EISDIR is damage to a reader
        if not storage.capabilities.directories:
            raise
        storage.delete_dir(path)  # an empty directory that walk_files took for a file


def _size_or_zero(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except CheckpointError:
        return 0


# --------------------------------------------------------------------------------------------
# Retention


def _check_count(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"RetentionPolicy.{name} must be an int >= 1 or None, got {value!r}")
    if value < 1:
        raise ValueError(f"RetentionPolicy.{name} must be >= 1 or None, got {value}")


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed steps to keep.

    ``keep_last``: the N newest committed steps. ``keep_every``: every step divisible by N
    (e.g. ``keep_every=10_000`` keeps long-term milestones). Both: the union. Neither: keep
    everything. Whatever the policy, the newest committed step and the steps in flight are
    always kept (see :func:`apply_retention`).
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last)
        _check_count("keep_every", self.keep_every)

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None

    def retained(self, steps: Iterable[int]) -> set[int]:
        """The subset of ``steps`` the policy keeps (before the newest/in-flight guarantees)."""
        ordered = sorted(set(steps))
        if self.keeps_all:
            return set(ordered)
        keep: set[int] = set()
        if self.keep_last is not None:
            keep.update(ordered[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        return keep


def apply_retention(
    storage: Storage, policy: RetentionPolicy, *, protect: Iterable[int] = ()
) -> list[int]:
    """Delete the committed steps ``policy`` does not retain; returns them, ascending.

    Never deletes the newest committed step, a step in ``protect`` (saves in flight, and the
    base steps an in-flight incremental save references), nor a file that a manifest which
    stays committed references. Each step goes manifest first, then its unreferenced files
    (the whole directory when none is referenced). Steps are processed newest first, so that
    a manifest referencing an older step's files is gone before those files are.

    A failure on one step is logged and the others continue. A step whose manifest was
    deleted but some of whose files could not be is returned (it is no longer committed) and
    its leftovers are reported for ``collect_garbage``. If any committed manifest cannot be
    read (a newer format, or damage since listing), nothing is deleted: its references are
    unknown.
    """
    protected = set(protect)
    steps = committed_steps(storage)
    if not steps or policy.keeps_all:
        return []
    keep = policy.retained(steps) | {steps[-1]} | (protected & set(steps))
    doomed = [s for s in steps if s not in keep]
    if not doomed:
        return []

    refs: dict[int, set[str]] = {}
    for s in steps:
        try:
            refs[s] = referenced_paths(s, load_manifest(storage, s))
        except IncompatibleFormatError as e:
            log.error(
                "retention under %s skipped: step %d cannot be read by this version, so the "
                "files it references are unknown (%s)", storage.url, s, e
            )
            return []
        except CheckpointError as e:
            if s in keep:
                log.error(
                    "retention under %s skipped: retained step %d could not be read (%s)",
                    storage.url, s, e,
                )
                return []
            log.warning("step %d under %s vanished or broke while applying retention: %s",
                        s, storage.url, e)
            doomed.remove(s)

    deleted: list[int] = []
    for s in sorted(doomed, reverse=True):
        name = step_dir(s)
        try:
            storage.delete(manifest_path(s))
        except Exception as e:  # noqa: BLE001 - one step's failure must not stop the rest
            log.error("retention: could not delete the manifest of step %d under %s: %s; "
                      "the step stays committed", s, storage.url, e)
            continue
        refs.pop(s, None)
        deleted.append(s)
        live: set[str] = set().union(*refs.values()) if refs else set()
        try:
            files = walk_files(storage, name)
            kept = [f for f in files if f in live]
            if not kept:
                storage.delete_dir(name)
            else:
                for f in files:
                    if f not in live:
                        _remove_file(storage, f)
        except Exception as e:  # noqa: BLE001
            log.error("retention: step %d under %s is uncommitted now, but deleting its files "
                      "failed (%s); `shardkeeper gc %s` removes the leftovers",
                      s, storage.url, e, storage.url)
            continue
        if kept:
            log.info("retention: deleted step %d under %s (kept %d file(s) that retained steps "
                     "reference)", s, storage.url, len(kept))
        else:
            log.info("retention: deleted step %d under %s", s, storage.url)
    return sorted(deleted)


# --------------------------------------------------------------------------------------------
# Garbage collection


@dataclass
class GcReport:
    """What ``collect_garbage`` removed (or, with ``dry_run``, would remove)."""

    root: str
    dry_run: bool
    removed_dirs: list[str] = field(default_factory=list)  # whole step directories
    removed_files: list[str] = field(default_factory=list)  # single files
    removed_bytes: int = 0
    skipped_young: list[str] = field(default_factory=list)  # too young: a save may be running
    kept_referenced: list[str] = field(default_factory=list)  # in uncommitted dirs, referenced
    errors: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)  # incomplete S3 multipart uploads

    @property
    def removed_paths(self) -> list[str]:
        return [*self.removed_dirs, *self.removed_files]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "dry_run": self.dry_run,
            "removed_dirs": self.removed_dirs,
            "removed_files": self.removed_files,
            "removed_bytes": self.removed_bytes,
            "skipped_young": self.skipped_young,
            "kept_referenced": self.kept_referenced,
            "errors": self.errors,
            "aborted_uploads": self.aborted_uploads,
        }


def collect_garbage(
    storage: Storage,
    *,
    min_age_s: float = DEFAULT_GC_MIN_AGE_S,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove what no committed checkpoint needs and no running save can still be writing.

    - A step directory without a committed manifest (a failed save, a torn manifest, or a
      step retention deleted while keeping files that other steps reference) whose newest file
      is older than ``min_age_s``: every file no committed manifest references; the whole
      directory when none is referenced.
    - In a committed step directory: files no committed manifest references (a losing
      writer's attempt files, temporary manifest files) older than ``min_age_s``.

    Only entries named like step directories are ever touched. ``min_age_s`` must exceed the
    longest a save can take (staging to commit); ``now`` (seconds since the epoch) is for tests.
    Raises ``IncompatibleFormatError`` if a committed manifest is of a newer format: the files
    it references are unknown, so nothing is removed.
    """
    if min_age_s < 0:
        raise ValueError(f"min_age_s must be >= 0, got {min_age_s}")
    now = time.time() if now is None else float(now)
    report = GcReport(root=storage.url, dry_run=dry_run)

    dirs = step_dirs(storage)
    committed = set(committed_steps(storage))
    referenced: set[str] = set()
    for s in sorted(committed):
        try:
            referenced |= referenced_paths(s, load_manifest(storage, s))
        except IncompatibleFormatError as e:
            raise IncompatibleFormatError(
                f"gc refuses to run on {storage.url}: {e}; its references are unknown"
            ) from e
        except CheckpointError as e:
            # Vanished (deleted concurrently) or broke since listing: treat it as uncommitted.
            log.warning("step %d under %s could not be read during gc: %s", s, storage.url, e)
            committed.discard(s)

    def age(path: str) -> float | None:
        try:
            return now - storage.mtime(path)
        except CheckpointError as e:
            report.errors.append(f"{storage.describe(path)}: {e}")
            return None

    def remove_file(path: str) -> None:
        size = _size_or_zero(storage, path)
        if not dry_run:
            try:
                _remove_file(storage, path)
            except Exception as e:  # noqa: BLE001
                report.errors.append(f"could not remove {storage.describe(path)}: {e}")
                return
        log.info("gc: %s %s (%d bytes)", "would remove" if dry_run else "removed",
                 storage.describe(path), size)
        report.removed_files.append(path)
        report.removed_bytes += size

    for s, name in sorted(dirs.items()):
        if name != step_dir(s):
            # "step-0000000000042" parses as step 42 but is not the name the format writes:
            # readers never look inside, so it is not ours to judge (or delete).
            log.warning("gc: leaving %s alone: not the canonical name %s",
                        storage.describe(name), step_dir(s))
            continue
        try:
            files = walk_files(storage, name)
        except CheckpointError as e:
            report.errors.append(f"could not list {storage.describe(name)}: {e}")
            continue
        if s in committed:
            manifest = f"{name}/{MANIFEST_NAME}"
            for f in files:
                if f == manifest or f in referenced:
                    continue
                a = age(f)
                if a is None:
                    continue
                if a < min_age_s:
                    report.skipped_young.append(f)
                    continue
                remove_file(f)
            continue

        ages = [a for a in (age(f) for f in files) if a is not None]
        if len(ages) < len(files):
            continue  # an mtime could not be read: leave the directory alone
        if not files:
            a = age(name)  # an empty directory (POSIX): its own mtime
            if a is None:
                continue
            ages = [a]
        if min(ages) < min_age_s:
            report.skipped_young.append(name)
            continue
        kept = [f for f in files if f in referenced]
        if kept:
            report.kept_referenced.extend(kept)
            for f in files:
                if f not in referenced:
                    remove_file(f)
            continue
        size = sum(_size_or_zero(storage, f) for f in files)
        if not dry_run:
            try:
                storage.delete_dir(name)
            except Exception as e:  # noqa: BLE001
                report.errors.append(f"could not remove {storage.describe(name)}: {e}")
                continue
        log.info("gc: %s %s (%d files, %d bytes)", "would remove" if dry_run else "removed",
                 storage.describe(name), len(files), size)
        report.removed_dirs.append(name + "/")
        report.removed_bytes += size
    _abort_incomplete_uploads(storage, referenced, min_age_s, now, dry_run, report)
    return report


def list_incomplete_uploads(storage: Storage) -> list[dict[str, Any]]:
    """Incomplete S3 multipart uploads of files under the root's step directories.

    Each: ``{"path", "key", "upload_id", "initiated"}`` (path relative to the root, initiated
    in seconds since the epoch). Empty on other backends: a GCS resumable session or a local
    temporary file is not listed this way (local leftovers are files gc already sees).
    """
    fs = getattr(storage, "fs", None)
    root = getattr(storage, "root", None)
    protocol = getattr(storage, "protocol", None)
    if fs is None or not isinstance(root, str) or protocol not in ("s3", "s3a"):
        return []
    bucket, _, prefix = root.partition("/")
    prefix = f"{prefix}/" if prefix else ""
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        for u in page.get("Uploads") or []:
            rel = str(u["Key"])[len(prefix):]
            if parse_step_dir(rel.split("/", 1)[0]) is None:
                continue  # only what the format writes is ours to judge
            initiated = u.get("Initiated")
            out.append({
                "path": rel, "key": u["Key"], "upload_id": u["UploadId"],
                "initiated": initiated.timestamp() if hasattr(initiated, "timestamp") else None,
            })
        if not page.get("IsTruncated"):
            return out
        kwargs["KeyMarker"] = page.get("NextKeyMarker")
        kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")


def _abort_incomplete_uploads(
    storage: Storage, referenced: set[str], min_age_s: float, now: float, dry_run: bool, report: GcReport
) -> None:
    """Abort incomplete multipart uploads initiated at least ``min_age_s`` ago (the same age
    rule as files: older than the longest save, so no running save owns them)."""
    try:
        uploads = list_incomplete_uploads(storage)
    except Exception as e:  # noqa: BLE001 - e.g. a store without the API: report, go on
        report.errors.append(f"could not list incomplete multipart uploads under {storage.url}: {e}")
        return
    fs = getattr(storage, "fs", None)
    bucket = str(getattr(storage, "root", "")).split("/", 1)[0]
    for u in uploads:
        if u["path"] in referenced:
            continue
        if u["initiated"] is not None and now - u["initiated"] < min_age_s:
            report.skipped_young.append(f"{u['path']} (multipart upload {u['upload_id']})")
            continue
        if not dry_run and fs is not None:
            try:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["key"], UploadId=u["upload_id"])
            except Exception as e:  # noqa: BLE001
                report.errors.append(f"could not abort the multipart upload of {storage.describe(u['path'])}: {e}")
                continue
        log.info("gc: %s incomplete multipart upload of %s", "would abort" if dry_run else "aborted",
                 storage.describe(u["path"]))
        report.aborted_uploads.append(u["path"])


__all__ = [
    "DEFAULT_GC_MIN_AGE_S",
    "GcReport",
    "RetentionPolicy",
    "apply_retention",
    "collect_garbage",
    "list_incomplete_uploads",
    "referenced_paths",
    "resolve_file",
    "walk_files",
]
