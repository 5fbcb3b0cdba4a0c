"""Whether a run may start training on its root, decided before its first training step.

A run saves at steps above the step it starts from (0 for a fresh run, the resumed step after
a resume). When its root already holds a committed step at or above the first step it could
save, the step rule (:mod:`.steps`) refuses every one of its saves up to that step: the run
would train until its first save and die there. So every adapter asks here before the first
training step (the Trainer's ``train()``, Lightning's ``on_train_start``, Accelerate's and
DeepSpeed's first ``backward``) and refuses such a run with the remedies: resume from the
root, use another root, or empty this one.

A run that resumed from its root's newest step, a second ``fit()`` of the same run (its step
count continues past its own saves) and a root that holds only what a crash left (no
manifest) all go ahead. A run that deliberately starts above the root's newest step (an
Accelerate iteration set by hand) goes ahead too: its saves can all commit.
"""

from __future__ import annotations

from shardkeeper.core.adapter.steps import check_save_step
from shardkeeper.core.errors import StartRefusedError
from shardkeeper.core.manager.manager import CheckpointManager


def check_start(
    mgr: CheckpointManager,
    start: int,
    who: str,
    *,
    resume: str,
    elsewhere: str,
    resumed: bool = False,
    source: str = "",
    first_save: int | None = None,
) -> None:
    """Raise :class:`StartRefusedError` when a run whose step count is ``start`` could save
    nothing in ``mgr``'s root up to its newest committed step; a collective (every rank of
    the manager's group calls it, and all raise together or none does).

    ``who`` prefixes the message (``"shardkeeper.accelerate"``); ``resume``: the adapter's
    call that resumes from the root; ``elsewhere``: how to give the run another root;
    ``resumed``/``source``: whether (and from what) the run resumed, for the message;
    ``first_save``: the lowest step the run could save (default ``start + 1``: a step is
    saved after it is trained).
    Steps count as the save's check counts them, by their manifests' names, so a newest step
    whose manifest cannot be read refuses the run too, with the remedy that deletes it."""
    first = start + 1 if first_save is None else first_save
    check = check_save_step(mgr, first)
    if not check.refused:
        return
    root, rank = mgr.storage.url, mgr.rank
    newest = check.newest if check.newest is not None else first
    at = f"{'resumes' if resumed else 'starts'} from step {start}{f' ({source})' if source else ''}"
    intact = mgr.agree(int(mgr.is_committed(newest)) if rank == 0 else 0)
    if not intact:  # listed by its manifest's name, which cannot be read
        raise StartRefusedError(
            f"{who}: step {newest} under {root} is damaged: its manifest cannot be read (rank {rank}). "
            f"This run {at} and could save no checkpoint up to step {newest} there. Delete the damaged "
            f"step (`shardkeeper delete {root} {newest} --damaged`, or remove its folder, "
            f"{mgr.step_url(newest)}), then resume ({resume}); or give this run another root ({elsewhere})",
            step=first,
            newest=newest,
        )
    raise StartRefusedError(
        f"{who}: {root} already holds committed step {newest} (rank {rank}); this run {at}, so it could "
        f"save no checkpoint up to step {newest} there: checkpoints are immutable. Resume from the newest "
        f"step ({resume}), or give this run another root ({elsewhere}), or start over with this root "
        f"emptied (remove it; `shardkeeper delete` keeps the newest step). If step {newest} is damaged, "
        f"delete it first: `shardkeeper delete {root} {newest} --damaged`",
        step=first,
        newest=newest,
    )


__all__ = ["check_start"]
