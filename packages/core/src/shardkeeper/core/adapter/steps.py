"""The step an adapter saves at, decided once for every rank.

Checkpoints are immutable and a root's newest committed step is what a resume goes back to,
so a save is refused when its step is already committed, or when it is *below* the newest
committed step: that save would commit, yet the next resume would silently restore the newer
(older-trained, or another run's) step instead. Refusing names both steps and the remedies
(resume from the root first, save at a higher step, or use another root); continuing above
the newest step instead would break the framework's own step numbering.

Rank 0 decides from its listing and every rank gets its answer (a collective on the caller's
thread), so all ranks raise together, or none does: ranks whose listings differ for a moment
never take different paths into the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkeeper.core.commit.committed import manifest_steps
from shardkeeper.core.errors import CommitConflictError, StepOrderError
from shardkeeper.core.manager.manager import CheckpointManager


@dataclass(frozen=True)
class StepCheck:
    """Rank 0's view of the root at one save, agreed by every rank."""

    root: str
    rank: int
    step: int
    newest: int | None
    """The newest committed step under the root (after this manager's own pending save)."""
    committed: bool
    """Whether ``step`` itself is committed."""

    @property
    def refused(self) -> bool:
        return self.committed or (self.newest is not None and self.step < self.newest)

    def error(self, framework: str, remedy: str = "") -> CommitConflictError | None:
        """The error of a refused save (None: the save may go ahead)."""
        tail = f" {remedy}" if remedy else ""
        if self.committed:
            return CommitConflictError(
                f"{framework}: step {self.step} is already committed under {self.root} (rank {self.rank}); "
                f"checkpoints are immutable: save at another step, or use another root.{tail}"
            )
        if self.newest is not None and self.step < self.newest:
            return StepOrderError(
                f"{framework}: step {self.step} is below the newest committed step {self.newest} under "
                f"{self.root} (rank {self.rank}): a resume from this root would go back to step "
                f"{self.newest}, not to the state saved now. Resume from the root first (the step count "
                f"then continues from {self.newest}), save at a step above {self.newest}, or use another "
                f"root.{tail}",
                step=self.step,
                newest=self.newest,
            )
        return None

    def raise_if_refused(self, framework: str, remedy: str = "") -> None:
        err = self.error(framework, remedy)
        if err is not None:
            raise err


def check_save_step(mgr: CheckpointManager, step: int) -> StepCheck:
    """Whether a save at ``step`` may go ahead, as rank 0 sees the root; call it on every rank.

    The manager's pending save is waited for first (``save()`` would wait for it anyway), so
    its step counts, and its failure is raised here. The steps are found by listing alone (no
    manifest is read: this runs on every save), as restore orders its candidates: a step whose
    manifest is damaged still counts (remove it, or ``shardkeeper verify`` the root).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r} (root {mgr.storage.url}, rank {mgr.rank})")
    mgr.wait()
    newest, committed = -1, 0
    if mgr.rank == 0:
        steps = manifest_steps(mgr.storage)
        newest = steps[-1] if steps else -1
        committed = int(step in steps)
    newest = mgr.agree(newest)
    committed = mgr.agree(committed)
    return StepCheck(
        root=mgr.storage.url, rank=mgr.rank, step=step, newest=None if newest < 0 else newest, committed=bool(committed)
    )


__all__ = ["StepCheck", "check_save_step"]
