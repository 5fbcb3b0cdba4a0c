"""Step claims: which writer a step of the persistent root belongs to, from before its local commit.

With a local tier a step commits on the nodes first and reaches the persistent root later, in
its upload, if ever. The fenced commit there would tell a second writer of the step (a
restarted job and its zombie, one configuration copied into two jobs) only in that upload,
after both saves were acknowledged. So, when uploads are on (``persist_every``), the
coordinator claims every step right before its local commit: it puts
``claim.<step dir>.json`` at the persistent root, naming this writer, with put-if-absent. A
claim another writer holds fails the save with ``StepClaimedError``, naming both writers; the
upload checks the claim again right before its persistent commit.

A claim is this writer's when it names this manager, or this manager's coordinator node (the
same local directory: its node token, at the same real path; a copy elsewhere is another
writer): a predecessor on this node, whose local commit of
the step would be in this very directory, where put-if-absent fences it. A persistent root
that cannot be reached at the claim does not fail the local commit (the tiers exist to
outlive a slow or absent object store): it is logged, and the upload takes the claim before
its commit.

Lifetime: the claims of steps up to one just persisted are removed after that commit (the
manifest speaks for them); a restore of the newest step takes over the claims above the step
it restored (their writer's steps are whole on no node this job sees: a job that lost its
nodes), warning with their writers' names, and keeps those (so that their first writer's
upload is told who took them over); ``delete(step)`` removes this writer's claim of a step
gone from every tier; ``shardkeeper gc`` removes claims of steps at or below the root's newest
committed step (``spent_claims``). An upload whose claim is gone while the root holds that
step or a newer one is refused too. Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.commit.committed import manifest_steps
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError, CommitConflictError, StepClaimedError
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)

#: Claims are files at the root whose names start so: ``claim.step-000000001200.json``.
PREFIX = "claim."
_MAX_BYTES = 64 << 10


def claim_path(step: int) -> str:
    return f"{PREFIX}{step_dir(step)}.json"


def claimed_step(name: str) -> int | None:
    """The step a root entry's name claims, or None when it is no claim."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    if not base.startswith(PREFIX) or not base.endswith(".json"):
        return None
    step = parse_step_dir(base[len(PREFIX) : -len(".json")])
    return step if step is not None and claim_path(step) == base else None


def list_claims(storage: Storage) -> list[int]:
    """The steps claimed at the root, ascending."""
    return sorted(s for name in storage.list_dir("") if (s := claimed_step(name)) is not None)


def spent_claims(storage: Storage, newest: int | None) -> list[str]:
    """The claims of steps at or below ``newest`` (the root's newest committed step): a save
    at such a step is refused anyway (``commit/step_rule.py``), so no claim of it protects anything."""
    if newest is None:
        return []
    return [claim_path(s) for s in list_claims(storage) if s <= newest]


@dataclass(frozen=True)
class Writer:
    """One manager as its claims name it: a random id, its coordinator's host, process and
    local directory, and that directory's node token (``nodes.node_token``)."""

    id: str
    host: str
    pid: int
    local: str
    node: str

    @classmethod
    def new(cls, local: str, node: str) -> Writer:
        return cls(secrets.token_hex(4), socket.gethostname(), os.getpid(), local, node)

    def body(self, step: int, attempt: str, took_over: str | None = None) -> bytes:
        doc: dict[str, Any] = {
            "kind": "step-claim",
            "step": step,
            "writer": self.id,
            "host": self.host,
            "pid": self.pid,
            "local": self.local,
            "node": self.node,
            "attempt": attempt,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if took_over is not None:
            doc["took_over_from"] = took_over
        return json.dumps(doc, separators=(",", ":")).encode()

    def describe(self) -> str:
        return f"writer {self.id} (host {self.host}, pid {self.pid}, local tier {self.local})"


def describe(held: dict[str, Any]) -> str:
    """A claim's writer, as messages name it."""
    if not held.get("writer"):
        return "a writer whose claim does not parse (a hand edit, or not shardkeeper's)"
    took = f", taken over from {held['took_over_from']}" if held.get("took_over_from") else ""
    return (
        f"writer {held.get('writer')} (host {held.get('host')}, pid {held.get('pid')}, local tier "
        f"{held.get('local')}, claimed at {held.get('created_at')}{took})"
    )


class Claims:
    """The claims of one manager (its coordinator's: ``writer`` None on the other ranks, or
    when uploads are off, and then every method does nothing). ``storage``: the persistent
    root, unencrypted."""

    def __init__(self, storage: Storage, writer: Writer | None) -> None:
        self.storage, self.writer = storage, writer
        self.unclaimed: set[int] = set()  # committed locally while the root could not be reached
        self.taken: set[int] = set()  # taken over from another writer at a restore: kept (gc removes them)

    def _read(self, step: int) -> dict[str, Any] | None:
        """The claim of ``step``; None when there is none; ``{}`` when it does not parse."""
        try:
            data = self.storage.read_bytes(claim_path(step))
        except CheckpointNotFoundError:
            return None
        try:
            doc = json.loads(data[:_MAX_BYTES])
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def _mine(self, held: dict[str, Any]) -> bool:
        assert self.writer is not None
        if held.get("writer") == self.writer.id:
            return True
        # The same directory (its node token, at its real path): a predecessor on this node. A
        # copy of the directory elsewhere (``cp -a``, a disk snapshot) carries the token but
        # is another job's.
        node = held.get("node")
        return bool(node) and node == self.writer.node and held.get("local") == self.writer.local

    def _conflict(self, step: int, held: dict[str, Any], what: str) -> StepClaimedError:
        assert self.writer is not None
        return StepClaimedError(
            f"step {step} of {self.storage.url} is claimed by another {describe(held)}; this is "
            f"{self.writer.describe()}, so {what}. Two jobs are writing this root (a restarted job and its zombie, "
            f"or one configuration in two jobs): stop the other one, or save under another root. A job whose "
            f"predecessor died on other nodes takes over its steps with restore() (the newest step) before saving; "
            f"`{claim_path(step)}` at the root names the claim's writer"
        )

    def take(self, step: int, attempt: str) -> None:
        """Coordinator, right before its local commit of ``step``: claim it, or raise
        ``StepClaimedError`` when another writer holds it."""
        if self.writer is None:
            return
        try:
            for _ in range(2):  # (a claim removed between the put and the read: once more)
                try:
                    self.storage.put_if_absent(claim_path(step), self.writer.body(step, attempt))
                    return
                except CommitConflictError:
                    held = self._read(step)
                if held is None:
                    continue
                if self._mine(held):
                    return
                raise self._conflict(step, held, "this save's files were discarded and nothing was committed")
        except StepClaimedError:
            raise
        except CheckpointError as e:  # the root unreachable: commit locally, claim in the upload
            log.warning(
                "step %d: could not claim it at %s (%s: %s); it is committed in the local tier unclaimed, and its "
                "upload claims it first",
                step,
                self.storage.url,
                type(e).__name__,
                e,
            )
            self.unclaimed.add(step)

    def check(self, step: int) -> StepClaimedError | None:
        """Coordinator, right before the persistent commit of ``step``: None when the claim is
        this writer's (taken now when it is missing), else the conflict. Raises
        ``CheckpointError`` when the root cannot be read (the upload fails)."""
        if self.writer is None:
            return None
        for _ in range(2):
            held = self._read(step)
            if held is None:
                newest = max(manifest_steps(self.storage), default=None)
                if newest is not None and newest >= step:  # its claims up to there were removed
                    return StepClaimedError(
                        f"step {step} of {self.storage.url} is no longer claimed, and the root holds step {newest}: "
                        f"another writer committed it there and removed the claims up to it; this is "
                        f"{self.writer.describe()}, so this step was not uploaded (it stays in the local tier "
                        f"only). Two jobs are writing this root: stop the other one, or save under another root"
                    )
                try:
                    self.storage.put_if_absent(claim_path(step), self.writer.body(step, "upload"))
                    self.unclaimed.discard(step)
                    return None
                except CommitConflictError:
                    continue
            if self._mine(held):
                return None
            return self._conflict(step, held, "this step was not uploaded (it stays in the local tier only)")
        return None  # (put and removed twice in a row: nobody else holds it)

    def sweep(self, upto: int) -> None:
        """Coordinator, once ``upto`` is committed to the persistent root: the claims of steps
        up to it go (best effort: ``gc`` removes what is left)."""
        if self.writer is None:
            return
        try:
            for path in spent_claims(self.storage, upto):
                if claimed_step(path) not in self.taken:
                    self.storage.delete(path)
        except CheckpointError as e:
            log.warning("step %d persisted, but the claims up to it were not all removed: %s", upto, e)

    def take_over(self, above: int | None, persisted: Iterable[int]) -> list[str]:
        """Coordinator, after restoring the newest step (``above``; None: nothing was
        restored): the claims of steps above it become this writer's, with a warning naming
        their writers, and claims of persisted steps go. Returns what was taken over."""
        if self.writer is None:
            return []
        done = set(persisted)
        taken: list[str] = []
        try:
            for step in list_claims(self.storage):
                if above is not None and step <= above:
                    continue
                if step in done:  # committed there: the manifest speaks for it
                    self.storage.delete(claim_path(step))
                    continue
                held = self._read(step)
                if held is None or self._mine(held):
                    continue
                self.storage.put(claim_path(step), self.writer.body(step, "restore", took_over=describe(held)))
                self.taken.add(step)
                taken.append(f"step {step} from {describe(held)}")
        except CheckpointError as e:
            log.warning("the claims at %s were not all taken over after the restore: %s", self.storage.url, e)
        if taken:
            msg = (
                f"{self.storage.url}: this job ({self.writer.describe()}) takes over {len(taken)} step claim(s) above "
                f"the step it restored: {'; '.join(taken[:4])}{' ...' if len(taken) > 4 else ''}. Their writer "
                f"committed them in its local tier, whole on no node this job sees (a job that lost its nodes). If "
                f"that writer still runs (two jobs on one root), stop it: its uploads of those steps are refused"
            )
            log.warning(msg)
            warnings.warn(msg, stacklevel=6)  # (the caller of restore())
        return taken

    def release(self, step: int) -> None:
        """Coordinator: this writer's claim of ``step`` removed (a step deleted from every tier)."""
        if self.writer is None:
            return
        try:
            held = self._read(step)
            if held is not None and self._mine(held):
                self.storage.delete(claim_path(step))
        except CheckpointError as e:
            log.warning("the claim of deleted step %d at %s stays: %s", step, self.storage.url, e)


__all__ = ["PREFIX", "Claims", "Writer", "claim_path", "claimed_step", "describe", "list_claims", "spent_claims"]
