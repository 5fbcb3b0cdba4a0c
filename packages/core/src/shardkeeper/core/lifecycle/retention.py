"""Retention: which committed checkpoints to keep, and deleting the others (``lifecycle/gc.py``
removes what is left over).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.commit import intents as pending
from shardkeeper.core.commit.committed import committed_steps, load_manifest, manifest_path
from shardkeeper.core.commit.files import (
    committed_since,
    referenced_paths,
    remove_file,
    resolve_file,
    walk_files,
)
from shardkeeper.core.config.schedule import KeepBest, check_keep_best
from shardkeeper.core.errors import (
    CheckpointError,
    IncompatibleFormatError,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.lifecycle.best import best_steps
from shardkeeper.core.lifecycle.gc import (  # gc, once here: still importable from here
    DEFAULT_GC_MIN_AGE_S,
    GcReport,
    collect_garbage,
    list_incomplete_uploads,
)
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)

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
    (e.g. ``keep_every=10_000`` keeps long-term milestones). ``keep_best=(n, metric, mode)``:
    the n steps with the lowest (``"min"``) or highest (``"max"``) ``metadata[metric]``
    (``lifecycle/best.py``). Several: the union. None of the three: keep everything.
    ``keep_steps``: these steps as well (an adapter pins the best checkpoint so far, the
    Trainer's ``load_best_model_at_end``). Whatever the policy, the newest committed step and
    the steps in flight are always kept (see :func:`apply_retention`).
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_steps: frozenset[int] = frozenset()
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last)
        _check_count("keep_every", self.keep_every)
        object.__setattr__(self, "keep_best", check_keep_best(self.keep_best, "RetentionPolicy.keep_best"))
        steps = self.keep_steps
        if not isinstance(steps, frozenset) or any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
            raise ValueError(f"RetentionPolicy.keep_steps must be a frozenset of ints, got {steps!r}")

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def retained(
        self, steps: Iterable[int], metadata: Mapping[int, Mapping[str, Any]] | None = None, where: str = ""
    ) -> set[int]:
        """The subset of ``steps`` the policy keeps (before the newest/in-flight guarantees).
        ``keep_best`` ranks by ``metadata`` (step -> its manifest's metadata); without it,
        every step may be among the best and is kept. ``where``: the root, for the warning
        about steps without the metric."""
        keep = self.by_count(steps)
        if self.keep_best is not None:
            keep |= set(steps) if metadata is None else best_steps(self.keep_best, steps, metadata, where)
        return keep

    def by_count(self, steps: Iterable[int]) -> set[int]:
        """What ``retained`` keeps by the rules that need only the step numbers: all but
        ``keep_best``."""
        ordered = sorted(set(steps))
        if self.keeps_all:
            return set(ordered)
        keep: set[int] = set()
        if self.keep_last is not None:
            keep.update(ordered[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        keep.update(s for s in ordered if s in self.keep_steps)
        return keep


class DeleteOnly(RetentionPolicy):
    """A retention policy that drops exactly the given steps (for ``delete()``)."""

    def __init__(self, steps: frozenset[int]) -> None:
        super().__init__()
        object.__setattr__(self, "_drop", steps)

    @property
    def keeps_all(self) -> bool:
        return False

    def retained(
        self, steps: Iterable[int], metadata: Mapping[int, Mapping[str, Any]] | None = None, where: str = ""
    ) -> set[int]:
        return self.by_count(steps)

    def by_count(self, steps: Iterable[int]) -> set[int]:
        drop: frozenset[int] = self._drop  # type: ignore[attr-defined]
        return set(steps) - drop


def apply_retention(storage: Storage, policy: RetentionPolicy, *, protect: Iterable[int] = ()) -> list[int]:
    """Delete the committed steps ``policy`` does not retain; returns them, ascending.

    Never deletes the newest committed step, a step in ``protect`` (saves in flight, and the
    base steps an in-flight incremental save references), nor a file that a manifest which
    stays committed references, nor one that a commit in progress is about to reference (its
    intent, commit/intents.py). Every doomed step's manifest goes first (newest first, so that a
    manifest referencing an older step's files is gone before those files are), then the
    intents are read, then the unreferenced files (the whole directory when none is kept).
    ``keep_best`` ranks the steps by the metadata of the manifests read for their references
    (no read of its own); a step whose manifest cannot be read is not among the best.

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
    keep = policy.by_count(steps) | {steps[-1]} | (protected & set(steps))
    doomed = [s for s in steps if s not in keep]
    if not doomed:
        return []
    # Every manifest is read once: for the metric keep_best ranks by, then for the references.
    loaded = _load_manifests(storage, steps)
    if policy.keep_best is not None:
        metadata = {s: m.metadata for s, m in loaded.items() if isinstance(m, Manifest)}
        keep |= best_steps(policy.keep_best, metadata, metadata, storage.url)  # (unreadable ones: below)
        doomed = [s for s in doomed if s not in keep]
        if not doomed:
            return []
    refs = _references(storage, loaded, keep)
    if refs is None:
        return []
    deleted = _delete_manifests(storage, [s for s in doomed if s in refs])
    if not deleted:
        return []
    gone = set(deleted)
    live: set[str] = set().union(*(r for s, r in refs.items() if s not in gone))
    return delete_unreferenced(storage, deleted, live, set(steps), "retention")


def _load_manifests(storage: Storage, steps: list[int]) -> dict[int, Manifest | CheckpointError]:
    """Each step's manifest, or the error that reading it raised."""
    loaded: dict[int, Manifest | CheckpointError] = {}
    for s in steps:
        try:
            loaded[s] = load_manifest(storage, s)
        except CheckpointError as e:
            loaded[s] = e
    return loaded


def _references(
    storage: Storage, loaded: dict[int, Manifest | CheckpointError], keep: set[int]
) -> dict[int, set[str]] | None:
    """The files each loaded step references, by step; None (logged) when nothing may be
    deleted: a step of a newer format or a retained step cannot be read. A doomed step that
    vanished or broke is left out, so it is not deleted; one with a damaged page references
    nothing (its files are listed when it is deleted)."""
    refs: dict[int, set[str]] = {}
    for s, got in loaded.items():
        try:
            if isinstance(got, CheckpointError):
                raise got
            try:
                refs[s] = referenced_paths(s, got)
            except CheckpointError as e:  # a page (format.md 3.9) that cannot be read
                if s in keep:  # what a retained step references is unknown: delete nothing
                    raise
                log.warning("step %d under %s is deleted with a damaged page: %s", s, storage.url, e)
                refs[s] = set()  # (a doomed step's references protect nothing; its files are listed)
        except IncompatibleFormatError as e:
            log.error(
                "retention under %s skipped: step %d cannot be read by this version, so the "
                "files it references are unknown (%s)",
                storage.url,
                s,
                e,
            )
            return None
        except CheckpointError as e:
            if s in keep:
                log.error(
                    "retention under %s skipped: retained step %d could not be read (%s)",
                    storage.url,
                    s,
                    e,
                )
                return None
            log.warning("step %d under %s vanished or broke while applying retention: %s", s, storage.url, e)
    return refs


def _delete_manifests(storage: Storage, doomed: list[int]) -> list[int]:
    """Delete the manifests of ``doomed``, newest first; returns the steps whose manifest went
    (a failure is logged, and that step stays committed). The steps stop being committed, and a
    commit that references them sees that (commit/intents.py); only then are intents read."""
    deleted: list[int] = []
    for s in sorted(doomed, reverse=True):
        try:
            storage.delete(manifest_path(s))
        except Exception as e:  # noqa: BLE001 - one step's failure must not stop the rest
            log.error(
                "retention: could not delete the manifest of step %d under %s: %s; the step stays committed",
                s,
                storage.url,
                e,
            )
            continue
        deleted.append(s)
    return deleted


def delete_unreferenced(storage: Storage, deleted: list[int], live: set[str], listed: set[int], who: str) -> list[int]:
    """After the manifests of ``deleted`` went: delete their files but those in ``live`` (what
    the steps that stay committed reference), in an intent of a commit in progress, or in a
    manifest put since ``listed`` was listed; the whole directory when none is kept. Returns
    ``deleted``, ascending. Failures are logged (``shardkeeper gc`` removes the leftovers)."""
    try:
        intents = pending.live_intents(storage)
    except CheckpointError as e:
        intents = [pending.PendingRecord("", "intent", [], set(), unknown=True)]
        log.error("%s under %s: could not read the commits in progress (%s)", who, storage.url, e)
    if any(r.unknown for r in intents):
        log.error(
            "%s under %s: a commit in progress cannot be read, so the files of deleted steps %s "
            "are kept; `shardkeeper gc %s` removes them later",
            who,
            storage.url,
            deleted,
            storage.url,
        )
        return sorted(deleted)
    live = live | {f for r in intents for f in r.files}  # what commits in progress are about to reference
    try:  # ... or referenced by manifests put since this pass listed the steps
        live |= committed_since(storage, listed)[1]
    except CheckpointError as e:
        log.error(
            "%s under %s: could not list the steps committed meanwhile (%s); the files of deleted steps %s are kept",
            who,
            storage.url,
            e,
            deleted,
        )
        return sorted(deleted)
    for s in deleted:
        name = step_dir(s)
        try:
            files = walk_files(storage, name)
            kept = [f for f in files if f in live]
            if not kept:
                storage.delete_dir(name)
            else:
                for f in files:
                    if f not in live:
                        remove_file(storage, f)
        except Exception as e:  # noqa: BLE001
            log.error(
                "%s: step %d under %s is uncommitted now, but deleting its files "
                "failed (%s); `shardkeeper gc %s` removes the leftovers",
                who,
                s,
                storage.url,
                e,
                storage.url,
            )
            continue
        if kept:
            log.info(
                "%s: deleted step %d under %s (kept %d file(s) that retained steps or commits in progress reference)",
                who,
                s,
                storage.url,
                len(kept),
            )
        else:
            log.info("%s: deleted step %d under %s", who, s, storage.url)
    return sorted(deleted)


__all__ = [
    "DEFAULT_GC_MIN_AGE_S",
    "DeleteOnly",
    "GcReport",
    "RetentionPolicy",
    "apply_retention",
    "collect_garbage",
    "delete_unreferenced",
    "list_incomplete_uploads",
    "referenced_paths",
    "resolve_file",
    "walk_files",
]
