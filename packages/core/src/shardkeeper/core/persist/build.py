"""How a manager with ``writer="process"`` gets its save protocol: what a persist process
cannot serve refused up front, the spec it is started with, its shared staging buffer."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.persist import locks
from shardkeeper.core.persist.channel import decode, encode
from shardkeeper.core.persist.client import PersistRunner
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.runtime.coordinator import StoreCoordinator
from shardkeeper.core.runtime.store_channel import server_address
from shardkeeper.core.save.hooks import SaveHooks
from shardkeeper.core.save.overlap import StagingGate
from shardkeeper.core.save.plan import PlanCache
from shardkeeper.core.save.recipe import codec_state
from shardkeeper.core.save.shared import SharedBuffers
from shardkeeper.core.save.stage import Stager
from shardkeeper.core.state import _torch_compat as tc


def checked_spec(
    root: Any,
    storage_options: Mapping[str, Any] | None,
    options: CheckpointOptions,
    *,
    rank: int,
    world_size: int,
    namespace: str,
    store: tuple[str, int] | None,
    where: str,
    tiers: dict[str, Any] | None = None,
    entry: str = "shardkeeper.core.persist.worker",
) -> PersistSpec:
    """The spec of a manager with ``writer="process"``, or a ``ValueError`` naming what cannot be
    handed to another process (checked by the channel's own encoding, before any save)."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    spec = PersistSpec(
        root,
        dict(storage_options or {}),
        options,
        rank,
        world_size,
        namespace,
        store,
        options.commit_group_ranks,
        tiers,
        entry,
    )
    parts = {
        "root": spec.root,
        "storage_options": spec.storage_options,
        "encryption": options.encryption,
        "options": options,
    }
    for name, value in parts.items():
        try:
            decode(encode("hello", value))
        except (TypeError, ValueError):
            kind = type(value).__name__ if name != "storage_options" else "a value in it"
            raise ValueError(
                f"writer='process' (root {where}, rank {rank}): {name}= ({kind}) cannot be handed to the persist "
                f"process, which rebuilds the writer from the core's own types and plain values only. Pass a path "
                f"or URL as the root, storage options of str/int/float/bool, encryption='env:VAR', 'file:PATH' or "
                f"the core's LocalKeyProvider; or use writer='thread'"
            ) from None
    return spec


def persist_runner(
    ctx: ManagerContext,
    options: CheckpointOptions,
    hooks: SaveHooks,
    *,
    root: Any,
    storage_options: Mapping[str, Any] | None,
    plans: PlanCache,
    gate: StagingGate,
    tiers: dict[str, Any] | None = None,
    entry: str = "shardkeeper.core.persist.worker",
) -> tuple[PersistRunner, Stager]:
    """The save protocol of a manager with ``writer="process"``, and its stager (staging into
    shared memory); a ``ValueError`` for what a persist process cannot serve, before any save.
    With a node-local tier, ``tiers`` holds its keywords (``PersistSpec``) and ``entry`` the
    module that runs the tiers' persist process."""
    where = f"(root {root}, rank {ctx.rank})"
    if tiers is not None:
        if not isinstance(tiers["local"], (str, os.PathLike)):
            raise ValueError(
                f"writer='process' reopens the local tier in the persist process: pass local= as a directory "
                f"path (not a {type(tiers['local']).__name__}), or use writer='thread' {where}"
            )
        tiers = {**tiers, "local": os.fspath(tiers["local"])}
    try:
        locks.check_dir()
    except CheckpointError as e:
        raise CheckpointError(f"writer='process' {where}: {e}") from None
    if isinstance(options.encryption, str) and ctx.encryption is not None:
        # The key as the manager read it now, not as the persist process would read it later
        # (an environment variable changed or unset meanwhile).
        options = options.replace(encryption=ctx.encryption.keys)
    if not hasattr(os, "memfd_create"):
        raise ValueError(f"writer='process' needs Linux (memfd_create) for its shared staging buffer {where}")
    namespace, store = "local-" + secrets.token_hex(8), None
    coord = ctx.coord
    if isinstance(coord, StoreCoordinator):
        namespace, store = coord.namespace, server_address(tc.group_store(coord.group))
        if store is None:
            raise ValueError(
                f"writer='process' with {ctx.world_size} ranks: the persist processes meet on the process group's "
                f"c10d store server, and this group's store is not a TCPStore (launch with torchrun, or "
                f"init_process_group with env:// or tcp://), or use writer='thread' {where}"
            )
    spec = checked_spec(
        root,
        storage_options,
        options,
        rank=ctx.rank,
        world_size=ctx.world_size,
        namespace=namespace,
        store=store,
        where=str(root),
        tiers=tiers,
        entry=entry,
    )
    buffers = SharedBuffers()
    stager = Stager(buffers)
    runner = PersistRunner(
        ctx,
        codecs=codec_state(ctx, options),
        stager=stager,
        plans=plans,
        gate=gate,
        hooks=hooks,
        spec=spec,
        buffers=buffers,
    )
    return runner, stager


__all__ = ["persist_runner"]
