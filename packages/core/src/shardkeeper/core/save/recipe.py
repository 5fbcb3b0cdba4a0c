"""How a ``SaveRunner`` is made from a manager's context and options: one recipe for the
manager (``manager/build.py``) and for the persist process that rebuilds its writer
(``persist/worker.py``), so that both write with the same codecs."""

from __future__ import annotations

from shardkeeper.core.codec import CodecState
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.save.hooks import SaveHooks
from shardkeeper.core.save.overlap import StagingGate
from shardkeeper.core.save.plan import PlanCache
from shardkeeper.core.save.runner import SaveRunner
from shardkeeper.core.save.stage import Stager


def codec_state(ctx: ManagerContext, options: CheckpointOptions) -> CodecState:
    """The codecs the options ask for, under the context's key when it encrypts."""
    keys = ctx.encryption.keys if ctx.encryption is not None else None
    return CodecState(
        incremental=options.incremental, compression=options.compression, level=options.compression_level, keys=keys
    )


def save_runner(
    ctx: ManagerContext,
    options: CheckpointOptions,
    hooks: SaveHooks,
    *,
    stager: Stager | None = None,
    plans: PlanCache | None = None,
    gate: StagingGate | None = None,
) -> SaveRunner:
    """A runner over ``ctx``; the staging state, plan cache and staging gate given (the
    manager holds them too) or fresh."""
    return SaveRunner(
        ctx,
        codecs=codec_state(ctx, options),
        stager=stager or Stager(),
        plans=plans or PlanCache(),
        gate=gate or StagingGate(),
        hooks=hooks,
    )


__all__ = ["codec_state", "save_runner"]
