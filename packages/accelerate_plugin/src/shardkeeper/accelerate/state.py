"""The Accelerator's state in shardkeeper's canonical namespaces (docs/format.md, 3.3).

| what Accelerate saves            | key                                              |
|----------------------------------|--------------------------------------------------|
| the model (one)                  | ``model/<fqn>``                                  |
| models (several, prepare order)  | ``model/<i>.<fqn>`` (as an ``nn.ModuleList``)    |
| optimizer (one / several)        | ``optim/...`` / ``optim/<j>/...``, keyed by FQN  |
| LR scheduler (one / several)     | ``sched/...`` / ``sched/<j>/...``                |
| gradient scaler                  | ``extra/grad_scaler/...``                        |
| ``register_for_checkpointing``   | ``extra/custom/<i>/...``                         |
| the step, save counter,          | ``progress/step`` (the core's progress schema),  |
| ``accelerator.step``              | ``progress/accelerate/{iteration,step}``         |
| DeepSpeed engine (model, optim,  | ``engine_state(engine)`` of the DeepSpeed        |
| its scheduler, counters)         | adapter: ``model``, ``optim``, ``sched``, ``progress/...`` |
| RNG of each rank                 | ``rng/<rank>/...``                               |
| DataLoader epoch/batch position  | ``data/<rank>/<i>/...``                          |
| the same at any world size       | ``extra/data_position/<i>/...`` (once)           |
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from torch import nn

from shardkeeper.accelerate import _internals as acci
from shardkeeper.accelerate.dataloaders import PREFIX, LoaderPositions
from shardkeeper.core import PerRank, RNGState
from shardkeeper.core.adapter import Progress as CheckpointProgress
from shardkeeper.core.adapter import ProgressTarget, progress_state

log = logging.getLogger(__name__)

#: The framework name in the manifest metadata and under ``progress/``.
FRAMEWORK = "accelerate"


def _indexed(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else {str(i): x for i, x in enumerate(items)}


def raw_optimizer(opt: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(opt, "optimizer", opt)


def models_entry(accelerator: Any) -> nn.Module | None:
    models = list(acci.prepared_models(accelerator))
    if not models:
        return None
    return models[0] if len(models) == 1 else nn.ModuleList(models)


class Progress(ProgressTarget):
    """``progress/``: the save's step, Accelerate's counters under ``accelerate/`` (the save
    iteration and ``accelerator.step``), and the DeepSpeed engine's counters when there is one.

    On restore it continues the step count of any checkpoint: Accelerate's own counters where
    it wrote them, else (another framework's checkpoint, or a plain core save) the next save
    iteration follows the checkpoint's step and ``accelerator.step`` is that step's count of
    micro-steps.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        step: int = 0,
        next_iteration: int | None = None,
        engine_progress: ProgressTarget | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.step = step
        self.next_iteration = (
            int(accelerator.project_configuration.iteration) if next_iteration is None else next_iteration
        )
        self.engine_progress = engine_progress

    def state_dict(self) -> dict[str, Any]:
        ours = {"iteration": self.next_iteration, "step": int(self.accelerator.step)}
        entry = progress_state(step=self.step, counters={FRAMEWORK: ours})
        if self.engine_progress is None:
            return entry
        return {**self.engine_progress.state_dict(), **entry}  # the engine's samples and counters too

    def load_progress(self, progress: CheckpointProgress) -> None:
        acc = self.accelerator
        after = max(progress.step, progress.checkpoint_step or 0) + 1  # the next save's step
        acc.project_configuration.iteration = progress.count(FRAMEWORK, "iteration", after)
        # another framework's checkpoint: the micro-steps of its steps (Accelerate's own: as saved)
        foreign = not progress.of(FRAMEWORK)
        micro = progress.step * int(acc.gradient_accumulation_steps) if foreign else int(acc.step)
        acc.step = progress.count(FRAMEWORK, "step", micro)
        if self.engine_progress is not None:
            self.engine_progress.load_progress(progress)


def global_rank() -> int:
    """This process's rank in torch.distributed (the core's rank): under DeepSpeed on CPU,
    Accelerate's ``process_index`` is 0 on every rank."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_deepspeed(accelerator: Any) -> bool:
    kind = accelerator.distributed_type
    return str(getattr(kind, "value", kind)) == "DEEPSPEED"


def deepspeed_engine(accelerator: Any) -> Any:
    """The one DeepSpeed engine Accelerate prepared (it supports one per Accelerator)."""
    models = list(acci.prepared_models(accelerator))
    if len(models) != 1:
        raise NotImplementedError(
            f"shardkeeper.accelerate: {len(models)} prepared models under DistributedType.DEEPSPEED "
            f"(rank {global_rank()}); shardkeeper saves exactly one DeepSpeed engine per "
            f"Accelerator, as Accelerate's backward() supports. Prepare one model (several: wrap "
            f"them in one nn.Module)"
        )
    return models[0]


def deepspeed_engine_state(accelerator: Any) -> dict[str, Any]:
    """The DeepSpeed adapter's canonical state of the engine, found through its entry point."""
    from shardkeeper.core.adapter import load_adapter

    return dict(load_adapter("deepspeed").engine_state(deepspeed_engine(accelerator)))


def build_state(
    accelerator: Any,
    *,
    step: int = 0,
    next_iteration: int | None = None,
    present: Collection[str] | None = None,
    resume_dataloaders: bool = True,
) -> dict[str, Any]:
    """The state dict for ``CheckpointManager.save`` / ``restore`` (same structure for both).

    ``step``: the step of a save (``progress/step``). ``present``: the checkpoint's keys on restore; optional parts it lacks are left out (with
    a warning) instead of failing, so a checkpoint written elsewhere still restores here.
    """

    missing: list[str] = []

    def has(prefix: str) -> bool:
        if present is None:
            return True
        ok = any(k == prefix or k.startswith(prefix + "/") for k in present)
        if not ok:
            missing.append(prefix)
        return ok

    state: dict[str, Any] = {}
    ds = is_deepspeed(accelerator)
    engine: dict[str, Any] = deepspeed_engine_state(accelerator) if ds else {}
    if ds:
        state["model"] = engine["model"]
        if has("optim"):
            state["optim"] = engine["optim"]
    else:
        model = models_entry(accelerator)
        if model is not None:
            state["model"] = model
        opts = [raw_optimizer(o) for o in acci.prepared_optimizers(accelerator)]
        if opts and has("optim"):
            state["optim"] = _indexed(opts)
    # Under DeepSpeed, a scheduler DeepSpeed owns comes with the engine's state; one Accelerate
    # wraps itself (a torch LRScheduler) is saved like any other.
    scheds = [s for s in acci.prepared_schedulers(accelerator) if type(s).__name__ != "DeepSpeedSchedulerWrapper"]
    if "sched" in engine:
        scheds = [engine["sched"]]
    if scheds and has("sched"):
        state["sched"] = _indexed(scheds)
    extra: dict[str, Any] = {}
    if accelerator.scaler is not None and has("extra/grad_scaler"):
        extra["grad_scaler"] = accelerator.scaler
    custom = list(acci.registered_objects(accelerator))
    if custom and has("extra/custom"):
        extra["custom"] = {str(i): o for i, o in enumerate(custom)}
    dataloaders = list(acci.prepared_dataloaders(accelerator))
    positions = LoaderPositions(dataloaders, resume=resume_dataloaders)
    if dataloaders and (present is None or any(k.startswith(PREFIX + "/") for k in present)):
        extra["data_position"] = positions.global_positions(present)  # restored before data/
    if extra:
        state["extra"] = extra
    state["progress"] = Progress(
        accelerator, step=step, next_iteration=next_iteration, engine_progress=engine.get("progress")
    )
    # rng before data: a DataLoader's resume point needs the checkpoint's RNG already set.
    if has("rng"):
        state["rng"] = RNGState()
    if dataloaders and has("data"):
        state["data"] = PerRank(positions)
    if missing:
        log.warning(
            "shardkeeper: the checkpoint has no %s; those parts of the state keep their current values",
            ", ".join(missing),
        )
    return state


__all__ = [
    "FRAMEWORK",
    "Progress",
    "build_state",
    "deepspeed_engine",
    "deepspeed_engine_state",
    "global_rank",
    "is_deepspeed",
    "log",
    "models_entry",
    "raw_optimizer",
]
