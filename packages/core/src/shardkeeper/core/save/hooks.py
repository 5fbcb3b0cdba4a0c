"""What the save protocol (``save/runner.py``) asks of its manager's tiers: the ``SaveHooks`` it
calls at fixed points of every save, and ``Committed``, what they get once a step is committed.

``OneRoot`` is a manager's without tiers: nothing before the commit, retention on the
coordinator after it. A local tier's (``tiers/strategy.py``) replicate each rank's files to
its peers before the report, claim and offer the step around the commit, and record, upload
and retain it per node after it. The hooks run on the save's background thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from shardkeeper.core.commit.protocol import COORDINATOR
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.storage.base import Storage


@dataclass(frozen=True)
class Committed:
    """A committed save as its hooks get it: the ``files`` this rank wrote (root-relative path
    -> size); on the coordinator the ``manifest`` it committed and its bytes ``data`` (sealed
    when encrypted), None on the other ranks."""

    files: Mapping[str, int]
    manifest: Manifest | None = None
    data: bytes | None = None


class SaveHooks(Protocol):
    """The points of a save where the manager's tiers act (every rank, in this order)."""

    @property
    def tiered(self) -> bool:
        """Whether saves span a local tier (a term every rank of a save shares)."""
        ...

    @property
    def other_root(self) -> Storage | None:
        """A second root whose committed steps count too: a save of a step committed there, or
        below its newest, is refused (``commit/step_rule.py``)."""
        ...

    @property
    def checked(self) -> Callable[[str], bool] | None:
        """Which files (root-relative) the coordinator's commit checks; None: all."""
        ...

    def after_write(self, step: int, files: Mapping[str, int] | None) -> None:
        """Every rank, once per save (a refused one too), before it reports: ``files`` it
        wrote (root-relative path -> size), None when it failed or refused. A failure fails
        the save on this rank."""
        ...

    def before_commit(self, seq: int, step: int, attempt: str, data: bytes) -> None:
        """Coordinator, right before it puts the manifest (its bytes ``data``) of ``step``;
        a failure fails the commit."""
        ...

    def commit_failed(self, seq: int) -> None:
        """Coordinator: the commit of save ``seq`` failed after ``before_commit`` may have run."""
        ...

    def after_commit(self, seq: int, step: int, committed: Committed, retention: RetentionPolicy) -> None:
        """Every rank, ``step`` committed: what follows a commit (``retention``: the
        manager's, as the save was started)."""
        ...


class OneRoot:
    """The save hooks of a manager without tiers: after a commit, the coordinator applies
    retention to the root (``lifecycle/delete.py``); nothing else."""

    tiered = False
    other_root: Storage | None = None
    checked: Callable[[str], bool] | None = None

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    def after_write(self, step: int, files: Mapping[str, int] | None) -> None:
        pass

    def before_commit(self, seq: int, step: int, attempt: str, data: bytes) -> None:
        pass

    def commit_failed(self, seq: int) -> None:
        pass

    def after_commit(self, seq: int, step: int, committed: Committed, retention: RetentionPolicy) -> None:
        ctx = self.ctx
        if ctx.rank == COORDINATOR:
            deletion.retain(ctx.storage, retention, ctx.settings.catalog, step)


__all__ = ["Committed", "OneRoot", "SaveHooks"]
