"""The Accelerator's state in shardkeeper's canonical namespaces (DESIGN.md section 2).

| what Accelerate saves            | key                                              |
|----------------------------------|--------------------------------------------------|
| the model (one)                  | ``model/<fqn>``                                  |
| models (several, prepare order)  | ``model/<i>.<fqn>`` (as an ``nn.ModuleList``)    |
| optimizer (one / several)        | ``optim/...`` / ``optim/<j>/...``, keyed by FQN  |
| LR scheduler (one / several)     | ``sched/...`` / ``sched/<j>/...``                |
| gradient scaler                  | ``extra/grad_scaler/...``                        |
| ``register_for_checkpointing``   | ``extra/custom/<i>/...``                         |
| save counter, ``accelerator.step``| ``progress/iteration``, ``progress/step``       |
| RNG of each rank                 | ``rng/<rank>/...``                               |
| DataLoader epoch/batch position  | ``data/<rank>/<i>/...``                          |
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from torch import nn

from shardkeeper.accelerate.dataloaders import LoaderPositions
from shardkeeper.core import PerRank, RNGState

log = logging.getLogger(__name__)

#: Namespaces a checkpoint may lack (written by the core directly, or by another framework).
OPTIONAL = ("optim", "sched", "extra/grad_scaler", "extra/custom", "progress/iteration", "progress/step", "rng", "data")


def _indexed(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else {str(i): x for i, x in enumerate(items)}


def raw_optimizer(opt: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(opt, "optimizer", opt)


def models_entry(accelerator: Any) -> nn.Module | None:
    models = list(accelerator._models)
    if not models:
        return None
    return models[0] if len(models) == 1 else nn.ModuleList(models)


class Progress:
    """The counters Accelerate keeps: the save iteration and ``accelerator.step``."""

    def __init__(self, accelerator: Any, keys: Collection[str] = ("iteration", "step")) -> None:
        self.accelerator = accelerator
        self.keys = tuple(keys)
        self.next_iteration = int(accelerator.project_configuration.iteration)

    def state_dict(self) -> dict[str, Any]:
        vals = {"iteration": self.next_iteration, "step": int(self.accelerator.step)}
        return {k: vals[k] for k in self.keys}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "iteration" in sd:
            self.accelerator.project_configuration.iteration = int(sd["iteration"])
        if "step" in sd:
            self.accelerator.step = int(sd["step"])


def build_state(
    accelerator: Any,
    *,
    next_iteration: int | None = None,
    present: Collection[str] | None = None,
    resume_dataloaders: bool = True,
) -> dict[str, Any]:
    """The state dict for ``CheckpointManager.save`` / ``restore`` (same structure for both).

    ``present``: the checkpoint's keys on restore; optional parts it lacks are left out (with
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
    model = models_entry(accelerator)
    if model is not None:
        state["model"] = model
    opts = [raw_optimizer(o) for o in accelerator._optimizers]
    if opts and has("optim"):
        state["optim"] = _indexed(opts)
    scheds = list(accelerator._schedulers)
    if scheds and has("sched"):
        state["sched"] = _indexed(scheds)
    extra: dict[str, Any] = {}
    if accelerator.scaler is not None and has("extra/grad_scaler"):
        extra["grad_scaler"] = accelerator.scaler
    custom = list(accelerator._custom_objects)
    if custom and has("extra/custom"):
        extra["custom"] = {str(i): o for i, o in enumerate(custom)}
    if extra:
        state["extra"] = extra
    keys = [k for k in ("iteration", "step") if has(f"progress/{k}")] if present is not None else ["iteration", "step"]
    if keys:
        prog = Progress(accelerator, keys)
        if next_iteration is not None:
            prog.next_iteration = next_iteration
        state["progress"] = prog
    # rng before data: a DataLoader's resume point needs the checkpoint's RNG already set.
    if has("rng"):
        state["rng"] = RNGState()
    if accelerator._dataloaders and has("data"):
        state["data"] = PerRank(LoaderPositions(list(accelerator._dataloaders), resume=resume_dataloaders))
    if missing:
        log.warning("shardkeeper: the checkpoint has no %s; those parts of the state keep their current values",
                    ", ".join(missing))
    return state
