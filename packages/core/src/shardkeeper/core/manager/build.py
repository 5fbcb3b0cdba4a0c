"""How a ``CheckpointManager`` is made: its own keywords checked (``ManagerKeywords``; the root
and the other keywords by ``config/arguments.py``), then its parts built and wired
(``build_parts``): the options, the roots and the tier strategy (``tiers/strategy.py``), the
coordinator, the thread pools, the staging state, the save protocol and the save schedule
(``schedule.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.config.arguments import MANAGER_PARAMETERS, check_count, describe_keywords
from shardkeeper.core.config.options import OPTION_NAMES, CheckpointOptions, describe_unknown, given_options
from shardkeeper.core.format.jsonvalue import snapshot
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.manager.schedule import RecordedTimings, SaveSchedule
from shardkeeper.core.persist.build import persist_runner
from shardkeeper.core.persist.uploads import RemoteUploads
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.runtime.coordinator import Coordinator, make_coordinator
from shardkeeper.core.save.overlap import StagingGate
from shardkeeper.core.save.plan import PlanCache
from shardkeeper.core.save.recipe import save_runner
from shardkeeper.core.save.runner import SaveRunner
from shardkeeper.core.save.stage import Stager
from shardkeeper.core.storage import Storage
from shardkeeper.core.tiers import process_writer
from shardkeeper.core.tiers.strategy import TierSettings, TierStrategy, make_strategy, open_roots, tier_where
from shardkeeper.core.tiers.tiering import Tiering
from shardkeeper.core.tiers.two_tiers import TwoTiers


@dataclass(frozen=True)
class ManagerKeywords:
    """The manager's keywords checked before its root: ``given`` the options passed as
    keywords (they override ``options=``), the retention counts, and the tier keywords."""

    given: dict[str, Any]
    keep_last: int | None
    keep_every: int | None
    tiers: TierSettings

    @classmethod
    def checked(cls, arguments: Mapping[str, Any]) -> ManagerKeywords:
        """``arguments``: the constructor's (its ``locals()``). An unknown keyword is a
        ``TypeError`` naming the close matches; then the counts, then the tier keywords."""
        given = given_options(arguments)
        unknown = arguments["unknown_options"]
        if unknown:
            names = describe_unknown(unknown, MANAGER_PARAMETERS + OPTION_NAMES)
            raise TypeError(f"unknown CheckpointManager keyword(s): {names}; {describe_keywords()}")
        keep_last = check_count("keep_last", arguments["keep_last"])
        keep_every = check_count("keep_every", arguments["keep_every"])
        tiers = TierSettings.checked(
            arguments["local"],
            arguments["persist_every"],
            arguments["replicas"],
            arguments["local_keep"],
            arguments.get("erasure"),
            tier_where(arguments.get("root")),
        )
        return cls(given, keep_last, keep_every, tiers)


@dataclass(frozen=True)
class ManagerParts:
    """What a manager is made of, wired together."""

    options: CheckpointOptions
    retention: RetentionPolicy
    metadata: dict[str, Any]
    storage: Storage
    coord: Coordinator
    ctx: ManagerContext
    io: ThreadPoolExecutor
    bg: ThreadPoolExecutor
    stager: Stager
    plans: PlanCache
    gate: StagingGate
    strategy: TierStrategy
    tiering: Tiering | None
    saver: SaveRunner
    schedule: SaveSchedule


def build_parts(
    root: Any,
    keywords: ManagerKeywords,
    options: CheckpointOptions | None,
    storage_options: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    process_group: Any,
) -> ManagerParts:
    """The parts of a manager over ``root`` (arguments checked): a collective in a process
    group (the coordinator, and with two tiers ``Tiering``, meet the other ranks)."""
    tiers = keywords.tiers
    base = tiers.check_options((options or CheckpointOptions()).replace(**keywords.given))
    retention = RetentionPolicy(keep_last=keywords.keep_last, keep_every=keywords.keep_every, keep_best=base.keep_best)
    roots = open_roots(tiers, root, storage_options, base)
    meta, _ = snapshot(dict(metadata or {}), "metadata key")
    coord = make_coordinator(
        process_group, group_ranks=base.commit_group_ranks, tiered=tiers.tiered, persist=base.writer == "process"
    )
    io = ThreadPoolExecutor(base.io_threads, thread_name_prefix="shardkeeper-io")
    ctx = ManagerContext(roots.storage, roots.read, coord, base, io, roots.encryption)
    strategy, tiering = make_strategy(tiers, roots, ctx, retention)
    bg = ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-save")
    plans, gate = PlanCache(), StagingGate()
    saver: SaveRunner
    if base.writer == "process":  # (persist/client.py)
        saver, stager = persist_runner(
            ctx,
            base,
            strategy,
            root=root,
            storage_options=storage_options,
            plans=plans,
            gate=gate,
            tiers=_persist_tiers(tiers, retention),
            entry=process_writer.ENTRY if tiers.tiered else "shardkeeper.core.persist.worker",
        )
        if isinstance(strategy, TwoTiers):  # the uploads run in the persist process
            strategy.uploads = RemoteUploads(saver)
    else:
        stager = Stager()
        saver = save_runner(ctx, base, strategy, stager=stager, plans=plans, gate=gate)
    schedule = SaveSchedule(
        base,
        rank=coord.rank,
        agree=(lambda v: v) if coord.world_size == 1 else (lambda v: coord.agree_int(v, "bcast")),
        timings=RecordedTimings(lambda: ctx.read_storage),
        where=f"(root {roots.storage.url}, rank {coord.rank})",
    )
    return ManagerParts(
        base,
        retention,
        meta,
        roots.storage,
        coord,
        ctx,
        io,
        bg,
        stager,
        plans,
        gate,
        strategy,
        tiering,
        saver,
        schedule,
    )


def _persist_tiers(tiers: TierSettings, retention: RetentionPolicy) -> dict[str, Any] | None:
    """The tier keywords a persist process reopens the tiers with (``persist/spec.py``)."""
    if not tiers.tiered:
        return None
    return {
        "local": tiers.local,
        "persist_every": tiers.persist_every,
        "replicas": tiers.replicas,
        "local_keep": tiers.local_keep,
        "erasure": tiers.erasure,
        "retention": retention,
    }


__all__ = ["ManagerKeywords", "ManagerParts", "build_parts"]
