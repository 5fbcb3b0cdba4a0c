"""A save's outcome as the error its ranks raise: the coordinator's published failure turned
into ``StepClaimedError``, ``CommitConflictError`` or ``CheckpointSaveError``."""

from __future__ import annotations

from shardkeeper.core.commit.protocol import Outcome
from shardkeeper.core.errors import CheckpointSaveError, CommitConflictError, StepClaimedError


def raise_failed(step: int, outcome: Outcome, rank: int, url: str) -> None:
    """Raise the failure ``outcome`` names, as rank ``rank`` of a save of ``step`` to ``url``
    sees it; return when the step committed."""
    f = outcome.failure
    if f is None:
        return
    claimed = f"{StepClaimedError.__name__}: "
    if f.conflict and f.error.startswith(claimed):  # another writer's claim (commit/claim.py), as it says
        raise StepClaimedError(f"{f.error[len(claimed) :]} (rank {rank})")
    if f.conflict:
        raise CommitConflictError(
            f"step {step} was committed under {url} by another writer while "
            f"this save ran (two jobs on one root: a restarted job racing a zombie); this "
            f"save's files were discarded. Stop the other writer, or save under another root"
        )
    raise CheckpointSaveError(
        f"save of step {step} failed on rank {f.rank} in phase {f.phase} at {f.path}: {f.error}; "
        f"the checkpoint was not committed",
        step=step,
        failures={f.rank: f.to_json()},
    )


__all__ = ["raise_failed"]
