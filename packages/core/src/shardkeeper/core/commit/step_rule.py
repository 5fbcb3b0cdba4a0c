"""The steps a manager's save may not take: the root's refusal, found before a byte is written.

Refused: a step already committed (one stat of its manifest at every save: an off-by-one
after a resume, a fresh run on a used root; checkpoints are immutable), and a step *below*
the root's newest committed step (the step rule, as the adapters' ``check_save_step``): it
would commit, yet a resume goes back to the newest step, so the state trained last would be
silently lost. The newest committed step is what a resume restores, so retention never
deletes it (``lifecycle/retention.py``) and the advice never says to delete an intact one; only
``delete(step, damaged=True)`` (``shardkeeper delete --damaged``) removes it, once verification
finds it damaged, or a restore that fell back past it quarantines it (``lifecycle/quarantine.py``).

Cost: one listing per manager (its first save), then this manager's own commits raise the
newest step it knows. A step below that is refused only after a fresh listing agrees, so a
stale view (a step removed by hand) never refuses a legal save; it can only miss a higher
step that another manager on the root committed meanwhile. Every rank decides from the same
storage; a writer committing between the ranks' looks can split them, which the protocol
reports as a failed save on every rank (``SaveRunner.run_refused``). The fenced commit stays
the guarantee against a writer racing this one for the same step; nothing fences a racing
writer's higher step.
"""

from __future__ import annotations

from shardkeeper.core.commit.committed import manifest_path, newest_committed
from shardkeeper.core.errors import CheckpointError, CommitConflictError, StepOrderError
from shardkeeper.core.storage.base import Storage


class StepOrder:
    """One manager's view of its root's newest committed step, and the refusals it gives."""

    def __init__(self, storage: Storage, rank: int, also: Storage | None = None) -> None:
        """``also``: a second root whose steps count too (the persistent root behind a local tier)."""
        self._storage = storage
        self._also = also
        self._rank = rank
        self._listed = False  # whether the root was listed yet
        self._newest: int | None = None
        self._newest_in = storage  # the root that holds the newest step (messages name it)
        self.own: int | None = None  # the newest step this manager committed (PreemptionGuard.final_save)

    def refusal(self, step: int) -> CommitConflictError | None:
        """Why a save at ``step`` is refused (None: it may go ahead). A storage that fails
        here refuses nothing: the save goes ahead, and fails (or is fenced) at its commit."""
        storage = self._storage
        try:
            if storage.exists(manifest_path(step)) or (
                self._also is not None and self._also.exists(manifest_path(step))
            ):
                return self._committed_error(step, self._relist())
            newest = self._newest if self._listed else self._relist()
            if newest is None or step >= newest:
                return None
            newest = self._relist()  # refused only if the root still says so
        except CheckpointError:
            return None
        if newest is None or step >= newest:
            return None
        return StepOrderError(
            f"step {step} is below the newest committed step {newest} under {self._newest_in.url} (rank "
            f"{self._rank}); this save wrote nothing: a resume from this root goes back to step "
            f"{newest}, not to the state saved now. {_remedies(newest)}",
            step=step,
            newest=newest,
        )

    def committed(self, step: int) -> None:
        """Every rank, once this manager committed ``step``."""
        if self.own is None or step > self.own:
            self.own = step
        if self._newest is None or step > self._newest:
            self._newest, self._newest_in = step, self._storage

    def _relist(self) -> int | None:
        self._newest, self._newest_in = newest_committed(self._storage), self._storage
        if self._also is not None:
            other = newest_committed(self._also)
            if other is not None and (self._newest is None or other > self._newest):
                self._newest, self._newest_in = other, self._also
        self._listed = True
        return self._newest

    def _committed_error(self, step: int, newest: int | None) -> CommitConflictError:
        storage = self._storage  # (or the second root, when only that one holds the step)
        if self._also is not None and not storage.exists(manifest_path(step)):
            storage = self._also
        where = f"under {storage.url} ({storage.describe(manifest_path(step))} exists; rank {self._rank})"
        if newest is not None and step < newest:
            return StepOrderError(
                f"step {step} is already committed {where}, below the newest committed step {newest}; "
                f"this save wrote nothing. Checkpoints are immutable, and a resume from this root goes "
                f"back to step {newest}. {_remedies(newest)}",
                step=step,
                newest=newest,
            )
        if newest == step:
            return CommitConflictError(
                f"step {step} is already committed {where}, and it is the newest committed step; this "
                f"save wrote nothing. Checkpoints are immutable, and an intact newest step is never deleted "
                f"(a resume goes back to it): save at a step above {step} (after a resume, the steps after the "
                f"one restore() returned), or save under another root. If step {step} is damaged, "
                f"`shardkeeper delete {storage.url} {step} --damaged` removes it (with --key for an encrypted root)"
            )
        return CommitConflictError(  # a manifest that does not validate: damage, or a hand edit
            f"step {step} has a manifest {where} that does not validate; this save wrote nothing. "
            f"Check the root with `shardkeeper verify {storage.url}`, then save at a step above {step}, "
            f"save under another root, or remove the damaged step: `shardkeeper delete {storage.url} {step} "
            f"--damaged` (with --key for an encrypted root)"
        )


def _remedies(newest: int) -> str:
    return (
        f"Resume from the newest step first (restore() without step=, then save the steps after "
        f"it), save at a step above {newest}, or save under another root"
    )


__all__ = ["StepOrder"]
