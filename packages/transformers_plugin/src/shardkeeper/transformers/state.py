"""The Trainer's state in shardkeeper's canonical namespaces (docs/format.md, 3.3).

| what the Trainer saves                 | key                                             |
|----------------------------------------|-------------------------------------------------|
| the model (unwrapped; an FSDP1 root)   | ``model/<fqn>``                                 |
| the optimizer                          | ``optim/...``, keyed by FQN                     |
| the LR scheduler                       | ``sched/...``                                   |
| the gradient scaler                    | ``extra/grad_scaler/...``                       |
| ``global_step``, completed epochs      | ``progress/step``, ``progress/epoch``           |
| the ``TrainerState`` (log history,     | ``progress/transformers/trainer_state`` (JSON)  |
| best metric, callback states)          |                                                 |
| RNG of each rank                       | ``rng/<rank>/...``                              |
| under DeepSpeed: the engine's model,   | ``engine_state(engine)`` of the DeepSpeed       |
| optimizer, scheduler and counters      | adapter: ``model``, ``optim``, ``sched``,       |
|                                        | ``progress/deepspeed/...``                      |

The train sampler's position, where the Trainer built the sampler, is added beside these as
``extra/data_position/0/...`` (``position.py``); with a sampler of the user's own the Trainer
finds the position from ``global_step`` and skips the batches already trained on.
``save_only_model`` leaves out ``optim``, ``sched``, ``extra`` (but the position) and ``rng``, as
the Trainer does.
Under DeepSpeed (ZeRO-1/2/3) the engine's state comes from the DeepSpeed adapter, found through
its entry point (``load_adapter("deepspeed")``, never imported): the same keys, so a ZeRO
checkpoint resumes in a DDP Trainer at another world size and the other way round.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from shardkeeper.core import RNGState
from shardkeeper.core.adapter import Progress as CheckpointProgress
from shardkeeper.core.adapter import ProgressTarget, progress_state

log = logging.getLogger(__name__)

#: The framework name in the manifest metadata and under ``progress/``.
FRAMEWORK = "transformers"
#: TrainerState fields that differ per rank: not saved (the Trainer sets them on every start).
PER_PROCESS = ("is_local_process_zero", "is_world_process_zero")


def raw_optimizer(opt: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(opt, "optimizer", opt)


def raw_model(trainer: Any) -> Any:
    """The model whose state is saved: without its DDP wrapper (the one the Trainer saves), or
    the FSDP1 root once Accelerate's FSDP plugin wrapped it (its inner module holds only flat
    views; torch's state-dict API gives the root's state by canonical FQN). A model FSDP2
    sharded in place (Accelerate's plugin with ``fsdp_version`` 2, or transformers at load
    time) is its own: DTensor parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(trainer.model, FullyShardedDataParallel):
        return trainer.model
    return trainer.accelerator.unwrap_model(trainer.model)


class TrainerProgress(ProgressTarget):
    """``progress/``: the step and completed epochs, and the whole ``TrainerState`` under
    ``transformers/trainer_state``. On restore it keeps the checkpoint's progress for the
    Trainer's ``_init_training_state``: the saved ``TrainerState`` where the Trainer wrote
    one, else (another framework's checkpoint) a new one at the checkpoint's step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: CheckpointProgress | None = None
        #: The DeepSpeed engine's counters (``progress/deepspeed/...``), set by ``build_state``.
        self.engine_progress: ProgressTarget | None = None

    def state_dict(self) -> dict[str, Any]:
        st = self.trainer.state
        saved = {k: v for k, v in dataclasses.asdict(st).items() if k not in PER_PROCESS}
        entry = progress_state(
            step=int(st.global_step), epoch=int(st.epoch or 0), counters={FRAMEWORK: {"trainer_state": saved}}
        )
        if self.engine_progress is None:
            return entry
        return {**self.engine_progress.state_dict(), **entry}  # the engine's samples and counters too

    def load_progress(self, progress: CheckpointProgress) -> None:
        self.loaded = progress
        if self.engine_progress is not None:
            self.engine_progress.load_progress(progress)

    def trainer_state(self) -> dict[str, Any]:
        """The ``TrainerState`` fields to resume with (the Trainer's own, or the step count
        and epoch of another framework's checkpoint)."""
        if self.loaded is None:  # (restore() reads it for every resumed step)
            raise RuntimeError("shardkeeper.transformers: the resumed step's progress was not read")
        return trainer_state_of(self.loaded)


def trainer_state_of(p: CheckpointProgress) -> dict[str, Any]:
    """The ``TrainerState`` fields a step's progress holds: the Trainer's own, or the step count
    and epoch of another framework's checkpoint."""
    saved = p.of(FRAMEWORK).get("trainer_state")
    if isinstance(saved, dict) and isinstance(saved.get("global_step"), int):
        return dict(saved)
    if saved is not None:
        log.warning(
            "shardkeeper: the checkpoint of step %s holds a trainer_state that is not one; the "
            "Trainer resumes at step %d with a new TrainerState",
            p.checkpoint_step,
            p.step,
        )
    return {"global_step": p.step, "epoch": float(p.epoch)}


def sharded_at_load(model: Any) -> bool:
    """Whether ``from_pretrained(distributed_config=...)`` sharded ``model`` (FSDP2 or tensor
    parallel, DTensor parameters) rather than a wrapper such as Accelerate."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def is_deepspeed(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def deepspeed_engine_state(trainer: Any) -> dict[str, Any]:
    """The DeepSpeed adapter's canonical state of the Trainer's engine (``model_wrapped`` once
    the Trainer prepared it), found through the adapter's entry point."""
    from shardkeeper.core.adapter import load_adapter

    engine = trainer.model_wrapped
    if type(engine).__name__ != "DeepSpeedEngine":
        raise RuntimeError(
            f"shardkeeper.transformers: the Trainer runs under DeepSpeed but has no engine yet "
            f"(model_wrapped is a {type(engine).__name__}); its state exists once train() has prepared it"
        )
    return dict(load_adapter("deepspeed").engine_state(engine))


def build_state(trainer: Any, progress: TrainerProgress, *, model_only: bool = False) -> dict[str, Any]:
    """The state dict for ``CheckpointManager.save`` / ``restore`` (the same for both).
    ``model_only``: the model and progress alone (``save_only_model``). Under DeepSpeed the
    Trainer's engine must exist (after ``_prepare_for_training``)."""
    engine = deepspeed_engine_state(trainer) if is_deepspeed(trainer) else {}
    progress.engine_progress = engine.get("progress")
    state: dict[str, Any] = {"model": engine["model"] if engine else raw_model(trainer), "progress": progress}
    if model_only:
        return state
    if engine:
        state["optim"] = engine["optim"]
    elif trainer.optimizer is not None:
        state["optim"] = raw_optimizer(trainer.optimizer)
    sched = engine.get("sched", trainer.lr_scheduler)  # DeepSpeed's scheduler wrapper has no state
    if sched is not None and type(sched).__name__ != "DeepSpeedSchedulerWrapper":
        state["sched"] = sched
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        state["extra"] = {"grad_scaler": scaler}
    state["rng"] = RNGState()
    return state


__all__ = [
    "FRAMEWORK",
    "PER_PROCESS",
    "TrainerProgress",
    "build_state",
    "deepspeed_engine_state",
    "is_deepspeed",
    "raw_model",
    "raw_optimizer",
    "sharded_at_load",
    "trainer_state_of",
]
