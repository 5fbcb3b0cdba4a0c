"""The save protocol of one rank, in ``commit/protocol.py``'s order.

Caller's thread: ``refusal`` (``commit/step_rule.py``: a step already committed, or below the
newest committed one, is refused before anything is written; ``run_refused`` then takes the
save's turn in the protocol), ``prepare`` (flatten, plan, stage: a ``SaveJob``). Background
thread: ``run`` (write: ``rank_write.py``; report, or collect and commit; publish or wait for
the outcome; raise the save's failure). The manager's tiers act at fixed points of both
(``save/hooks.py``: a local tier's replicas, claims and uploads; retention after a commit).
The runner holds no reference to the manager: what one save needs travels in its ``SaveJob``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from shardkeeper.core import metrics
from shardkeeper.core.codec import CodecState
from shardkeeper.core.codec.crypto import seal_manifest
from shardkeeper.core.commit.catalog import record_commit
from shardkeeper.core.commit.committed import write_latest_hint
from shardkeeper.core.commit.merge import assemble_manifest
from shardkeeper.core.commit.protocol import COMMITTED, COORDINATOR, Failure, Outcome, Phase, RankReport, Report
from shardkeeper.core.commit.put import commit_manifest
from shardkeeper.core.commit.step_rule import StepOrder
from shardkeeper.core.commit.terms import SaveTerms, agreed_options
from shardkeeper.core.errors import CheckpointError, CheckpointSaveError, CommitConflictError
from shardkeeper.core.format.jsonvalue import snapshot
from shardkeeper.core.format.layout import new_attempt_id, step_dir
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.runtime.store_channel import CoordinatorLostError, coordinator_lost
from shardkeeper.core.save.group import fold_group, unfold
from shardkeeper.core.save.handle import SaveHandle
from shardkeeper.core.save.hooks import Committed, SaveHooks
from shardkeeper.core.save.job import SaveJob, Start, outcome_timeout
from shardkeeper.core.save.outcome import raise_failed
from shardkeeper.core.save.overlap import OptimizerTensors, StagingGate, find_optimizers
from shardkeeper.core.save.plan import PlanCache
from shardkeeper.core.save.rank_write import write_rank
from shardkeeper.core.save.replicas import ReplicaSums
from shardkeeper.core.save.replicas import judge as judge_replicas
from shardkeeper.core.save.stage import Stager, raise_refused
from shardkeeper.core.save.timings import save_timings
from shardkeeper.core.state.flatten import flatten_for_save
from shardkeeper.core.state.quantize import state_metadata
from shardkeeper.core.util.version import shardkeeper_version

log = logging.getLogger(__name__)


def _holding(owner: object, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` with ``owner`` referenced until it returns."""
    fn(*args)


class SaveRunner:
    """The save protocol of one manager: its root, coordinator, codecs and staging state."""

    stage_always = False
    """Whether a synchronous save stages too (a writer in another process cannot read the
    caller's tensors), instead of writing large items from their own memory."""

    def __init__(
        self,
        ctx: ManagerContext,
        *,
        codecs: CodecState,
        stager: Stager,
        plans: PlanCache,
        gate: StagingGate,
        hooks: SaveHooks,
    ) -> None:
        """``hooks``: where the manager's tiers act in each save (``save/hooks.py``)."""
        self.ctx = ctx
        self._hooks = hooks
        self._codecs = codecs
        self._stager = stager
        self._plans = plans
        self._gate = gate
        self._order = StepOrder(ctx.storage, ctx.rank, also=hooks.other_root)
        binding = ctx.encryption.binding if ctx.encryption is not None else None
        self._options = agreed_options(ctx.settings, binding, tiered=hooks.tiered)

    def terms(self, step: int) -> SaveTerms:
        """What every rank of the save of ``step`` must share (``commit/terms.py``)."""
        return SaveTerms(step, self._options)

    # -- caller's thread ---------------------------------------------------------------------
    def refusal(self, step: int) -> CommitConflictError | None:
        """The root's refusal of a save at ``step`` (``commit/step_rule.py``), before anything is written."""
        return self._order.refusal(step)

    @property
    def newest_committed_save(self) -> int | None:
        """The newest step this runner's saves committed (None: none yet); reads no storage."""
        return self._order.own

    def prepare(
        self,
        step: int,
        seq: int,
        state: Mapping[str, Any],
        *,
        sync: bool,
        defaults: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        retention: RetentionPolicy,
    ) -> SaveJob:
        """Flatten, plan and stage ``state`` (``defaults``: the manager's metadata)."""
        ctx, settings = self.ctx, self.ctx.settings
        flat = flatten_for_save(state, ctx.rank)
        describe = settings.describe_layouts if settings.compression in (None, "none") else False
        try:
            plan, groups = self._plans.plan(
                flat, ctx.rank, ctx.world_size, settings.max_files_per_rank, settings.min_file_bytes, describe
            )
            # A synchronous save returns after the commit, so the caller cannot change its tensors
            # meanwhile: they are written from their own memory, without a staging copy.
            defer = None
            if settings.staging == "overlap" and not sync:
                optimizers = find_optimizers(state)
                self._gate.install(optimizers)
                owned = OptimizerTensors(optimizers)
                if owned:
                    defer = owned.owners
            sums = ReplicaSums(flat, plan, ctx.rank, ctx.world_size) if settings.logical_check != "off" else None
            spans, deferred = self._stager.stage_split(
                groups, copy=self.stage_always or not sync, defer=defer, token=plan.token, sources=plan.sources
            )
        except Exception as e:  # (a nested tensor fails the plan, a sparse or meta one the copy)
            raise_refused(flat, f"save of step {step} on rank {ctx.rank}", e)
            raise
        replicas = sums.member() if sums is not None else None  # (before save() returns)
        objects, extended = snapshot(plan.objects, "state key")  # by value, checked to come back exactly
        meta, _ = snapshot({**defaults, **state_metadata(state), **dict(metadata or {})}, "metadata key")
        return SaveJob(
            step,
            seq,
            new_attempt_id(),
            plan,
            groups,
            spans,
            objects,
            extended,
            meta,
            sync,
            retention,
            Start(),
            deferred,
            self._gate.begin(deferred) if deferred is not None else None,
            replicas,
        )

    def submit(self, bg: ThreadPoolExecutor, job: SaveJob, *, owner: object) -> SaveHandle:
        """``job`` handed to the background thread ``bg``; it waits for ``job.start``. ``owner``
        (the manager) is held until the save ends: at exit only live managers are waited for."""
        try:
            future = bg.submit(_holding, owner, self.run, job)
        except BaseException:
            if job.staged is not None:
                job.staged.set()  # nothing will copy: never leave an optimizer step waiting
            raise
        handle = SaveHandle(job.step, future, _staged=job.staged)
        handle.deferred_bytes = job.deferred.nbytes if job.deferred is not None else 0
        return handle

    def submit_refused(
        self, bg: ThreadPoolExecutor, step: int, seq: int, err: CheckpointError, *, owner: object
    ) -> SaveHandle:
        """The refused save's turn in the protocol (``run_refused``), its error already delivered
        (the caller raises it right now); ``owner`` as for ``submit``."""
        handle = SaveHandle(step, bg.submit(_holding, owner, self.run_refused, step, seq, err))
        handle._deliver()
        return handle

    # -- background thread -------------------------------------------------------------------
    def run_refused(self, step: int, seq: int, err: CheckpointError, phase: Phase = Phase.CHECK) -> None:
        """A save refused on this rank (or failed before its write, in ``phase``) still takes
        its turn: the coordinator hears a failure report (or publishes one), so no other rank
        waits for this rank's until the timeout."""
        ctx = self.ctx
        if ctx.world_size == 1:
            raise err
        try:  # its peers may wait for what it wrote (a local tier's replicas): nothing
            self._hooks.after_write(step, None)
        except Exception as e:  # the refusal is the error this save raises
            log.warning("step %d, rank %d: the peer replicas of a refused save: %s", step, ctx.rank, e)
        failure = Failure.of(ctx.rank, phase, ctx.storage.describe(step_dir(step)), err)
        terms = self.terms(step)
        if ctx.rank == COORDINATOR:
            ctx.coord.publish(seq, Outcome(failure), terms=terms)
        else:
            try:
                ctx.coord.report(seq, failure, terms=terms)
                ctx.coord.outcome(seq, outcome_timeout(ctx.settings.commit_timeout_s), step=step, terms=terms)
            except CoordinatorLostError as e:
                log.warning("step %d, rank %d: %s", step, ctx.rank, e)  # the refusal is this save's error
        raise err

    def run(self, job: SaveJob) -> None:
        """Write, report (or commit), hear the outcome, and raise the save's failure."""
        stall_s = job.start.wait()
        ctx, step = self.ctx, job.step
        sdir = step_dir(step)
        t0 = time.perf_counter()
        phase = Phase.WRITE
        own: Report
        try:
            if job.deferred is not None and job.staged is not None:
                phase = Phase.STAGE
                self._gate.run(job.deferred, job.staged)
                phase = Phase.WRITE
            own = write_rank(ctx, self._codecs, job, stall_s, t0)
        except BaseException as e:
            own = Failure.of(ctx.rank, phase, ctx.storage.describe(sdir), e)
            local_error: BaseException | None = e
        else:
            local_error = None
        files = (
            {f"{sdir}/{rel}": int(info["size_bytes"]) for rel, info in own.files.items()}
            if isinstance(own, RankReport)
            else None
        )
        try:  # every rank, whatever its write did: its peers may wait for it (a local tier's replicas)
            self._hooks.after_write(step, files)
        except BaseException as e:
            if local_error is None:
                phase, local_error = Phase.REPLICATE, e
                own = Failure.of(ctx.rank, phase, ctx.storage.describe(sdir), e)
        terms = self.terms(step)
        reported = False  # whether the coordinator may have this rank's report: it may have committed
        committed = Committed(files or {})
        try:
            if ctx.rank == COORDINATOR:
                outcome, committed = self._commit(job, own, committed)
                ctx.coord.publish(job.seq, outcome, terms=terms)
            else:
                sent: Report | None = own
                if ctx.coord.leads() and isinstance(own, RankReport):
                    sent = self._fold(job, own)
                if sent is not None:  # (None: a rank of this leader's group failed, and said so itself)
                    ctx.coord.report(job.seq, sent, terms=terms)
                    reported = isinstance(sent, RankReport)
                timeout_s = outcome_timeout(ctx.settings.commit_timeout_s)
                outcome = ctx.coord.outcome(job.seq, timeout_s, step=step, terms=terms)
        except CoordinatorLostError as e:
            raise coordinator_lost(step, ctx.rank, e, committed=None if reported else False) from e
        if local_error is not None:
            raise CheckpointSaveError(
                f"save of step {step} failed on rank {ctx.rank} in phase {phase} at "
                f"{ctx.storage.describe(sdir)}: {type(local_error).__name__}: {local_error}; "
                f"the checkpoint was not committed",
                step=step,
                failures={ctx.rank: own.to_json()},
            ) from local_error
        raise_failed(step, outcome, ctx.rank, ctx.storage.url)
        self._order.committed(step)
        metrics.record(metrics.LAST_COMMITTED_STEP, step, rank=ctx.rank, step=step)
        metrics.record(metrics.SAVE_SECONDS, time.perf_counter() - t0, rank=ctx.rank, step=step)
        try:
            self._hooks.after_commit(job.seq, step, committed, job.retention)
        except CoordinatorLostError as e:
            raise coordinator_lost(step, ctx.rank, e, committed=True) from e

    @property
    def lock_namespace(self) -> str:
        """The namespace of the in-flight locks this writer's saves hold (``persist/locks.py``;
        "": none, every save commits in this process)."""
        return ""

    def close(self, wait_s: float = 30.0) -> None:
        """Release what the writer holds beyond the manager's threads (nothing here; a persist
        process is told to end, and waited for up to ``wait_s``)."""

    def _fold(self, job: SaveJob, own: RankReport) -> Report | None:
        """A group leader: its group's folded report (``save/group.py``), a failure of
        its own, or None when a rank of its group reported a failure."""
        ctx = self.ctx
        try:
            got = ctx.coord.collect_group(
                job.seq, ctx.settings.commit_timeout_s, step=job.step, terms=self.terms(job.step)
            )
            if got is None or isinstance(got, Failure):
                return got
            report, written = self._fold_group(job, [own, *got])
            if written is not None:  # a leader reports only a durable page
                written.result()
            return report
        except BaseException as e:
            return Failure.of(ctx.rank, Phase.COMMIT, ctx.storage.describe(step_dir(job.step)), e)

    def _fold_group(self, job: SaveJob, reports: list[RankReport]) -> tuple[RankReport, Future[None] | None]:
        """``fold_group``: the folded report and its page's write, still under way."""
        ctx = self.ctx
        return fold_group(
            ctx.storage,
            step_dir(job.step),
            job.step,
            job.attempt,
            reports,
            algorithm=ctx.settings.digest,
            paging=bool(job.plan.described),
            executor=ctx.io,
        )

    def _commit(self, job: SaveJob, own: Report, committed: Committed) -> tuple[Outcome, Committed]:
        """Coordinator: collect reports, check tiling, write the manifest if absent; the
        outcome, and ``committed`` with the manifest once it is committed."""
        if isinstance(own, Failure):
            return Outcome(own), committed
        ctx, settings, step = self.ctx, self.ctx.settings, job.step
        sdir = step_dir(step)
        reports: list[RankReport] = []
        page: list[Future[None]] = []  # its own group's page, synced while it merges
        t_commit = time.perf_counter()
        try:
            if ctx.coord.leads():  # group commit: its own page (a group of one), as every leader writes one
                own, written = self._fold_group(job, [own])
                page += [written] if written is not None else []
            got = ctx.coord.collect(job.seq, own, settings.commit_timeout_s, step=step, terms=self.terms(step))
            if isinstance(got, Failure):
                return Outcome(got), committed
            reports, pages, refs = unfold(got)
            members = [r.members() for r in reports]
            manifest = assemble_manifest(
                step,
                job.attempt,
                members,
                world_size=ctx.world_size,
                digest=settings.digest,
                block_bytes=settings.digest_block_bytes,
                described=job.plan.described,
                pages=pages,
                metadata={
                    "framework": "torch",
                    "torch_version": str(torch.__version__),
                    "shardkeeper_version": shardkeeper_version(),
                    **job.metadata,
                    "timings": save_timings(members, time.perf_counter() - t_commit),
                },
            )
            judge_replicas(manifest, settings.logical_check, ctx.rank)  # (copies that disagree)
            enc = ctx.encryption
            data = manifest.dumps(sealed=enc is not None)
            data = data if enc is None else seal_manifest(data, enc.keys, enc.binding)
            bases = sorted({b for r in reports for b in r.bases})
            for w in page:  # durable before the intent names it (and before a tier records it)
                w.result()
            # Before the put: nothing may fail between it and the outcome (a local tier claims
            # the step and offers the manifest).
            self._hooks.before_commit(job.seq, step, job.attempt, data)
            commit_manifest(
                ctx.storage,
                step,
                manifest,
                data,
                bases=bases,
                references=refs,
                executor=ctx.io,
                checked=self._hooks.checked,
            )
        except BaseException as e:
            wait(page)  # (its page is discarded once written)
            self._discard_attempt(sdir, reports)
            self._hooks.commit_failed(job.seq)
            failure = Failure.of(
                COORDINATOR, Phase.COMMIT, ctx.storage.describe(sdir), e, conflict=isinstance(e, CommitConflictError)
            )
            return Outcome(failure), committed
        finally:
            wait(page)  # (a save that failed elsewhere returns only once its page is written)
        # The manifest is put: the step is committed and a retry would be refused, so nothing
        # from here on fails the save (a failure is logged and counted, never raised).
        try:
            write_latest_hint(ctx.storage, step)
        except Exception as e:  # a hint only; the manifest is the truth
            metrics.record(metrics.AFTER_COMMIT_ERRORS, 1, rank=ctx.rank, step=step, what="latest_hint")
            log.warning("step %d committed, but the LATEST hint was not updated: %s: %s", step, type(e).__name__, e)
        record_commit(settings.catalog, ctx.storage, step, manifest)  # logs and counts its own failures
        log.info("step %d committed at %s (%d leaves)", step, ctx.storage.describe(sdir), len(manifest.leaves))
        return COMMITTED, dataclasses.replace(committed, manifest=manifest, data=data)

    def _discard_attempt(self, sdir: str, reports: list[RankReport]) -> None:
        for r in reports:
            for rel in r.files:
                try:
                    self.ctx.storage.delete(f"{sdir}/{rel}")
                except CheckpointError:
                    pass


__all__ = ["SaveJob", "SaveRunner", "Start", "outcome_timeout"]
