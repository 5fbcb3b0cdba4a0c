"""Garbage collection: what failed or abandoned saves left behind.

Needs no torch: an operator runs it (``shardkeeper gc``) from any machine, while training
runs. Two rules keep it from removing what a running save needs:

- age: a leftover is removed only when older than ``min_age_s`` (a save still writing its
  files is younger than its slowest save takes); a save whose files gc removed anyway fails
  at its commit, which checks every file (never commits over missing bytes);
- the commit handshake (``commit/intents.py``): before removing anything of an uncommitted step
  directory (or single files of any), gc writes a claim naming those steps, then reads the intents of commits in
  progress, and leaves alone every step an intent is for and every file one references.
  A commit that starts its checks after the claim sees it and fails cleanly instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.commit import intents as pending
from shardkeeper.core.commit.claim import spent_claims
from shardkeeper.core.commit.committed import committed_steps, load_manifest, manifest_steps, step_dirs
from shardkeeper.core.commit.files import (
    committed_since,
    listed_dir,
    referenced_paths,
    remove_file,
    size_or_zero,
    walk_files,
)
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.format.manifest import MANIFEST_NAME
from shardkeeper.core.lifecycle.uploads import abort_incomplete_uploads, list_incomplete_uploads
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar

log = logging.getLogger(__name__)

#: Default minimum age of leftovers that ``collect_garbage`` removes: 2 hours, above the
#: longest a save with the default ``commit_timeout_s`` (30 min) can take before its commit
#: (a rank waits for the outcome for 2 x commit_timeout_s + 30 s).
DEFAULT_GC_MIN_AGE_S = 7200.0


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
    kept_in_flight: list[str] = field(default_factory=list)  # a commit in progress needs them
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
            "kept_in_flight": self.kept_in_flight,
            "errors": self.errors,
            "aborted_uploads": self.aborted_uploads,
        }


@dataclass
class _Plan:
    """What gc decided by age and references, before the handshake."""

    files: list[str] = field(default_factory=list)  # single files to remove
    dirs: dict[int, list[str]] = field(default_factory=dict)  # uncommitted step -> its files (whole dir)


def collect_garbage(
    storage: Storage,
    *,
    min_age_s: float = DEFAULT_GC_MIN_AGE_S,
    dry_run: bool = False,
    now: float | None = None,
    no_running_saves: bool = False,
    progress: bool | None = False,
) -> GcReport:
    """Remove what no committed checkpoint needs and no running save can still be writing.

    - A step directory without a committed manifest (a failed save, a torn manifest, or a
      step retention deleted while keeping files that other steps reference) whose newest file
      is older than ``min_age_s``: every file no committed manifest references; the whole
      directory when none is referenced.
    - In a committed step directory: files no committed manifest references (a losing
      writer's attempt files, temporary manifest files) older than ``min_age_s``.
    - Records of commits in progress and claims (``pending.*.json`` at the root) that expired.
    - A local tier's step claims (``claim.<step dir>.json``, ``commit/claim.py``) of steps at or
      below the newest committed step: spent (a save there is refused anyway). Claims above it
      name steps only a local tier holds, and stay.

    Never what a live commit intent names (its step, its files). Only entries named like step
    directories (and those records and claims) are ever touched. ``min_age_s`` must exceed the longest a
    save can take (staging to commit); ``no_running_saves=True`` says that no save is running
    on the root (the caller stopped every writer): records of commits in progress are then
    stale, and removed like any leftover. ``now`` (seconds since the epoch) is for tests.
    ``progress``: a bar on stderr over the paths removed (None: when stderr is a terminal;
    default off).
    Raises ``IncompatibleFormatError`` if a committed manifest is of a newer format: the files
    it references are unknown, so nothing is removed.
    """
    if min_age_s < 0:
        raise ValueError(f"min_age_s must be >= 0, got {min_age_s}")
    now = time.time() if now is None else float(now)
    report = GcReport(root=storage.url, dry_run=dry_run)
    listed = set(manifest_steps(storage))  # with a manifest now, valid or not
    committed, referenced = _committed_references(storage)
    plan = _plan(storage, committed, referenced, min_age_s, now, report)

    claim = None
    touched = set(plan.dirs) | {s for f in plan.files if (s := parse_step_dir(f.split("/", 1)[0])) is not None}
    if touched and not dry_run:
        claim = pending.write_claim(storage, touched, "gc")
    t0 = time.monotonic()
    verb = "gc (dry run)" if dry_run else "gc removing"
    shown = progress if plan.files or plan.dirs else False  # no bar for nothing to do
    bar = make_bar(len(plan.files) + len(plan.dirs), verb, shown, unit="path")
    try:
        records = pending.read_records(storage, now)
        busy = _busy(storage, records, listed | committed, no_running_saves, report)
        if busy is None:
            return report
        _remove_planned(storage, plan, busy, t0, bar, dry_run, report)
        _remove_stale_records(storage, records, claim, no_running_saves, dry_run, report)
        _remove_spent_claims(storage, committed, dry_run, report)
    finally:
        bar.close()
        if claim is not None:
            pending.remove(storage, claim)
    swept = abort_incomplete_uploads(storage, referenced, min_age_s, now, dry_run)
    report.skipped_young += swept.young
    report.errors += swept.errors
    report.aborted_uploads += swept.aborted
    return report


def _busy(
    storage: Storage, records: list[pending.PendingRecord], known: set[int], no_running_saves: bool, report: GcReport
) -> tuple[set[int], set[str]] | None:
    """The steps and files commits in progress need (``known``: the steps listed or committed
    when gc began); None, with an error reported, when a record of one cannot be read."""
    intents = [] if no_running_saves else [r for r in records if r.kind == "intent" and r.live]
    unknown = [r for r in intents if r.unknown]
    if unknown:
        report.errors.append(
            f"the record of a commit in progress {storage.describe(unknown[0].path)} cannot be read, so what "
            f"it protects is unknown; nothing was removed. A writer's records are written whole: if no "
            f"save is running, remove it (it expires by itself {pending.INTENT_TTL_S:.0f} s after it was "
            f"written)"
        )
        return None
    busy_steps = {s for r in intents for s in r.steps}
    busy_files = {f for r in intents for f in r.files}
    # A commit whose intent is already gone put its manifest before removing it: it is
    # listed now, and what it references is kept (its step too).
    new_steps, new_refs = committed_since(storage, known)
    return busy_steps | new_steps, busy_files | new_refs


def _remove_planned(
    storage: Storage,
    plan: _Plan,
    busy: tuple[set[int], set[str]],
    t0: float,
    bar: Any,
    dry_run: bool,
    report: GcReport,
) -> None:
    """Remove what ``plan`` names but ``busy`` (steps, files) does not, while gc's claim
    (taken at ``t0``) has time left."""
    busy_steps, busy_files = busy

    def in_time() -> bool:
        if time.monotonic() - t0 < pending.CLAIM_TTL_S / 2:
            return True
        report.errors.append(f"gc under {storage.url} stopped: its claim is about to expire; run it again")
        return False

    for f in plan.files:
        if f in busy_files:
            report.kept_in_flight.append(f)
        elif in_time():
            _remove(storage, f, dry_run, report)
        bar.update(1)
    for s, files in sorted(plan.dirs.items()):
        bar.update(1)
        if s in busy_steps:
            report.kept_in_flight.append(step_dir(s))
            continue
        if not in_time():
            break
        if any(f in busy_files for f in files):
            for f in files:
                if f in busy_files:
                    report.kept_in_flight.append(f)
                else:
                    _remove(storage, f, dry_run, report)
            continue
        _remove_dir(storage, step_dir(s), files, dry_run, report)


def _remove_spent_claims(storage: Storage, committed: set[int], dry_run: bool, report: GcReport) -> None:
    """A local tier's step claims at or below the newest committed step."""
    try:
        for path in spent_claims(storage, max(committed, default=None)):
            if not dry_run:
                storage.delete(path)
            report.removed_files.append(path)
    except CheckpointError as e:
        report.errors.append(f"could not remove the spent step claims under {storage.url}: {e}")


def _committed_references(storage: Storage) -> tuple[set[int], set[str]]:
    committed = set(committed_steps(storage))
    referenced: set[str] = set()
    for s in sorted(committed):
        try:
            m = load_manifest(storage, s)
        except IncompatibleFormatError as e:
            raise IncompatibleFormatError(f"gc refuses to run on {storage.url}: {e}; its references are unknown") from e
        except CheckpointError as e:
            # Vanished (deleted concurrently) or broke since listing: treat it as uncommitted.
            log.warning("step %d under %s could not be read during gc: %s", s, storage.url, e)
            committed.discard(s)
            continue
        try:
            referenced |= referenced_paths(s, m)
        except CheckpointError as e:  # a page (format.md 3.9) of a committed step: its files are unknown
            raise CorruptCheckpointError(
                f"gc refuses to run on {storage.url}: step {s} is committed, but the files it references cannot "
                f"all be read ({e}); run `shardkeeper verify` on the root, and delete the step or restore the "
                f"page before collecting garbage"
            ) from e
    return committed, referenced


def _plan(
    storage: Storage, committed: set[int], referenced: set[str], min_age_s: float, now: float, report: GcReport
) -> _Plan:
    plan = _Plan()

    def age(path: str) -> float | None:
        try:
            return now - storage.mtime(path)
        except CheckpointError as e:
            report.errors.append(f"{storage.describe(path)}: {e}")
            return None

    for s, name in sorted(step_dirs(storage).items()):
        if name != step_dir(s):
            # "step-0000000000042" parses as step 42 but is not the name the format writes:
            # readers never look inside, so it is not ours to judge (or delete).
            log.warning("gc: leaving %s alone: not the canonical name %s", storage.describe(name), step_dir(s))
            continue
        deep: list[str] = []
        try:
            files = walk_files(storage, name, unwalked=deep)
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
                else:
                    plan.files.append(f)
            continue
        ages = [a for a in (age(f) for f in files) if a is not None]
        if len(ages) < len(files):
            continue  # an mtime could not be read: leave the directory alone
        if deep:  # files deeper than any layout: their ages are unknown, so is the directory's
            log.warning(
                "gc: leaving %s alone: it holds a tree deeper than any layout (%s), whose files' ages are "
                "not read; remove it by hand if no save is writing there",
                storage.describe(name),
                storage.describe(deep[0]),
            )
            continue
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
            plan.files.extend(f for f in files if f not in referenced)
        else:
            plan.dirs[s] = files
    return plan


def _remove(storage: Storage, path: str, dry_run: bool, report: GcReport) -> None:
    """Remove a file ``walk_files`` listed; an empty directory or a folder marker it listed is
    removed and reported as a directory, of no bytes."""
    try:
        is_dir = listed_dir(storage, path)
        size = 0 if is_dir else size_or_zero(storage, path)
        if not dry_run:
            is_dir = remove_file(storage, path, is_dir)
    except Exception as e:  # noqa: BLE001
        report.errors.append(f"could not remove {storage.describe(path)}: {e}")
        return
    log.info("gc: %s %s (%d bytes)", "would remove" if dry_run else "removed", storage.describe(path), size)
    if is_dir:
        report.removed_dirs.append(path + "/")
    else:
        report.removed_files.append(path)
        report.removed_bytes += size


def _file_bytes(storage: Storage, files: list[str]) -> int:
    """The bytes of ``files`` as ``walk_files`` listed them (its directories hold none)."""
    total = 0
    for f in files:
        try:
            total += 0 if listed_dir(storage, f) else size_or_zero(storage, f)
        except CheckpointError:
            pass
    return total


def _remove_dir(storage: Storage, name: str, files: list[str], dry_run: bool, report: GcReport) -> None:
    size = _file_bytes(storage, files)
    if not dry_run:
        try:
            storage.delete_dir(name)
        except Exception as e:  # noqa: BLE001
            report.errors.append(f"could not remove {storage.describe(name)}: {e}")
            return
    log.info(
        "gc: %s %s (%d files, %d bytes)",
        "would remove" if dry_run else "removed",
        storage.describe(name),
        len(files),
        size,
    )
    report.removed_dirs.append(name + "/")
    report.removed_bytes += size


def _remove_stale_records(
    storage: Storage,
    records: list[pending.PendingRecord],
    own: str | None,
    no_running_saves: bool,
    dry_run: bool,
    report: GcReport,
) -> None:
    """Expired intents and claims (their writers died), or every intent when no save runs."""
    for r in records:
        if r.path == own or (r.live and not (no_running_saves and r.kind == "intent")):
            continue
        if not dry_run:
            pending.remove(storage, r.path)
        report.removed_files.append(r.path)


__all__ = ["DEFAULT_GC_MIN_AGE_S", "GcReport", "collect_garbage", "list_incomplete_uploads"]
