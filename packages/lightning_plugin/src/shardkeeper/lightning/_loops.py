"""Lightning's loop state at a given step and epoch, for checkpoints of other frameworks.

``Trainer.global_step`` and ``current_epoch`` come from the fit loop's progress counters,
which Lightning restores only from a checkpoint's ``loops`` entry. A checkpoint another
framework wrote has none, so the plugin gives Lightning the state of a fit loop that has
taken ``step`` optimizer steps and completed ``epoch`` epochs, starting the next epoch from
its first batch: the fresh loop's own ``state_dict()`` with those counters set, so every key
this Lightning version expects is there.
"""

from __future__ import annotations

from typing import Any, cast

#: The fit loop's counters set here (keys of ``fit_loop.state_dict()`` in Lightning 2.x).
OPTIMIZER_STEPS = "epoch_loop.automatic_optimization.optim_progress"
MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"
EPOCH_LOOP = "epoch_loop.state_dict"
EPOCHS = "epoch_progress"


def _set_counts(tracker: Any, value: int) -> None:
    """Every counter of a progress tracker (``{"total": {...}, "current": {...}}``) to ``value``."""
    for part in ("total", "current"):
        for k in list(tracker.get(part, {})):
            tracker[part][k] = value


def fit_loop_at(trainer: Any, *, step: int, epoch: int) -> dict[str, Any]:
    """``trainer.fit_loop.state_dict()`` as after ``step`` optimizer steps and ``epoch`` epochs."""
    sd = trainer.fit_loop.state_dict()
    missing = [k for k in (OPTIMIZER_STEPS, MANUAL_STEPS, EPOCH_LOOP, EPOCHS) if k not in sd]
    if missing:
        import lightning

        raise RuntimeError(
            f"Lightning {lightning.__version__}'s fit loop state has no {', '.join(missing)}; the shardkeeper "
            f"plugin cannot resume the step count of a checkpoint another framework wrote with this version"
        )
    lm = trainer.lightning_module
    if lm is None or lm.automatic_optimization:
        _set_counts(sd[OPTIMIZER_STEPS]["optimizer"]["step"], step)
        _set_counts(sd[OPTIMIZER_STEPS]["optimizer"]["zero_grad"], step)
    else:
        _set_counts(sd[MANUAL_STEPS], step)
    sd[EPOCH_LOOP]["_batches_that_stepped"] = step
    _set_counts(sd[EPOCHS], epoch)
    return cast("dict[str, Any]", sd)


__all__ = ["fit_loop_at"]
