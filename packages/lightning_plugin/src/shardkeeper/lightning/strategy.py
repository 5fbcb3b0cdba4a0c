"""What the Lightning plugin reads from a strategy, and its messages about paths.

Apart from the plugin (plugin.py) so that the plugin holds only the save, load and removal
flows: the DeepSpeed engine's canonical state (through the DeepSpeed adapter's entry point),
the module whose state is saved, the Trainer, the rank (and rank 0's answers for every rank),
the optimizer targets, and the error text for a path that names no shardkeeper checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from shardkeeper.core import CheckpointManager, errors
from shardkeeper.core.adapter import RootManagers
from shardkeeper.lightning import _internals as li


def engine_state(strategy: Any) -> dict[str, Any] | None:
    """Under ``DeepSpeedStrategy``: the DeepSpeed adapter's canonical state of the engine
    (``model``, ``optim``, ``progress``, maybe ``sched``); ``None`` for other strategies."""
    if not is_deepspeed(strategy):
        return None
    from shardkeeper.core.adapter import load_adapter

    engine = getattr(strategy, "model", None)
    if engine is None or not hasattr(engine, "optimizer"):
        raise RuntimeError(
            "DeepSpeedStrategy has no DeepSpeed engine yet (Trainer.fit() builds it); the "
            "shardkeeper Lightning plugin saves and restores the engine's state"
        )
    return cast("dict[str, Any] | None", load_adapter("deepspeed").engine_state(engine))


def is_deepspeed(strategy: Any) -> bool:
    return any(c.__name__ == "DeepSpeedStrategy" for c in type(strategy).__mro__)


def optim_target(opts: list[Any], n_saved: int, mgr: CheckpointManager, step: int) -> Any:
    if len(opts) != max(n_saved, 1):
        raise ValueError(
            f"step {step} under {mgr.storage.url} (rank {mgr.rank}) holds {n_saved} optimizer(s), "
            f"the LightningModule configures {len(opts)}; configure_optimizers() must return as "
            f"many optimizers as when it was saved"
        )
    return opts[0] if len(opts) == 1 else {str(i): o for i, o in enumerate(opts)}


def count(leaves: Mapping[str, Any], ns: str, marker: str) -> int:
    if f"{ns}/{marker}" in leaves:
        return 1
    n = 0
    while f"{ns}/{n}/{marker}" in leaves:
        n += 1
    return n


def model(strategy: Any) -> torch.nn.Module:
    """The module whose state is saved: the FSDP1 root when there is one, else the
    LightningModule (its FQNs are the canonical ones; wrapper prefixes are normalized away)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    m = strategy.model
    if isinstance(m, FullyShardedDataParallel):
        return m
    lm = strategy.lightning_module
    if lm is None:
        raise RuntimeError("the strategy has no LightningModule attached; nothing to checkpoint")
    return cast("torch.nn.Module", lm)


def trainer(strategy: Any) -> Any:
    lm = strategy.lightning_module
    return li.trainer_of(lm) if lm is not None else None


def rank(strategy: Any) -> int:
    return int(getattr(strategy, "global_rank", 0))


def on_rank0(strategy: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result on every rank; its failure is raised on every rank (a
    damaged or newer pointer as its own class, anything else as ``CheckpointNotFoundError``)."""
    out, err, kind = None, None, "CheckpointNotFoundError"
    if rank(strategy) == 0:
        try:
            out = fn()
        except _AS_THEMSELVES as e:
            err, kind = str(e), next(c.__name__ for c in _AS_THEMSELVES if isinstance(e, c))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"{type(e).__name__}: {e}"
    out, err, kind = strategy.broadcast((out, err, kind))
    if err is not None:
        raise getattr(errors, kind)(err)  # the class rank 0 met
    return out


_AS_THEMSELVES = (errors.CorruptCheckpointError, errors.IncompatibleFormatError)  # raised as such by on_rank0


def read_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options for a manager that only restores from another root: no retention there."""
    return {k: v for k, v in options.items() if k not in ("keep_last", "keep_every", "metadata")}


#: Where a Lightning user sets ``per_rank`` (named by the core's messages about it).
PER_RANK_CALL = "ShardkeeperCheckpointIO(root, per_rank=...)"


def root_managers(framework: str, version: str, options: Mapping[str, Any], **metadata: Any) -> RootManagers:
    """The plugin's managers: its options, and ``per_rank`` named as its argument."""
    return RootManagers(framework, version, options, per_rank_call=PER_RANK_CALL, **metadata)


def reading_manager(root: str, options: Mapping[str, Any]) -> CheckpointManager:
    """A manager that only restores from another root (``read_options``)."""
    mgr = CheckpointManager(root, **read_options(options))
    mgr.per_rank_call = PER_RANK_CALL
    return mgr


def not_ours(ckpt_path: Any, root: str) -> str:
    p = os.fspath(ckpt_path) if isinstance(ckpt_path, (str, os.PathLike)) else str(ckpt_path)
    if os.path.exists(p) or "://" in p:
        return (
            f"{p} is not a shardkeeper checkpoint (not a pointer file, not {root} or a step "
            f"under it). A Lightning .ckpt or sharded checkpoint directory is imported once with "
            f"shardkeeper.lightning.import_lightning_checkpoint({p!r}, {root!r}, "
            f"module=<your LightningModule> (for a .ckpt), trust_pickle=True), then resumed "
            f"from the step it returns (plugin.step_path(step))"
        )
    return (
        f"checkpoint path {p} does not exist, and it names no step under {root}; pass a path "
        f"ModelCheckpoint wrote, the root (newest committed step) or a step number"
    )


__all__ = [
    "count",
    "engine_state",
    "is_deepspeed",
    "model",
    "not_ours",
    "on_rank0",
    "optim_target",
    "rank",
    "read_options",
    "trainer",
]
