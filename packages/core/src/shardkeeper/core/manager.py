"""``CheckpointManager``: save and restore a training state, on every rank.

A façade: the commit protocol and its records are ``protocol.py``; a save's caller-side and
background halves ``saving.py`` (its handle ``handle.py``); restore with fallback
``restoring.py``; retention and ``delete()`` ``deletion.py``. Save on every rank: plan ->
stage (caller's thread) -> write -> report (background) -> commit on the coordinator
(rank 0) -> retain. Restore on every rank: discover -> plan -> ranged, verified reads ->
copy in place; all ranks agree on the step and on success, and "restore the newest" falls
back to the previous committed step when a step is damaged.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from shardkeeper.core import at_exit, deletion, metrics
from shardkeeper.core.codec import CodecState
from shardkeeper.core.commit import committed_steps, is_committed, load_manifest, newest_committed
from shardkeeper.core.context import ManagerContext, open_root
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.core.format.jsonvalue import snapshot
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.handle import SaveHandle
from shardkeeper.core.options import CheckpointOptions
from shardkeeper.core.progress import merge_back, read_progress, split_targets
from shardkeeper.core.restoring import Restorer
from shardkeeper.core.retention import RetentionPolicy
from shardkeeper.core.saving import SaveRunner
from shardkeeper.core.storage import Storage
from shardkeeper.core.tensor.coordination import make_coordinator
from shardkeeper.core.tensor.overlap import StagingGate
from shardkeeper.core.tensor.restore_plan import PER_RANK_POLICIES, RestoreStats
from shardkeeper.core.tensor.save_plan import PlanCache
from shardkeeper.core.tensor.staging import Stager

log = logging.getLogger(__name__)


def _selects_progress(pattern: str) -> bool:
    return fnmatch.fnmatchcase("progress/step", pattern) or pattern.rstrip("/*") == "progress"


class CheckpointManager:
    """Durable, async, resharding checkpoints under one root (a path or an fsspec URL).

    In a process group every rank creates the manager (a collective) and calls ``save()`` /
    ``restore()`` with its own local state, as with ``torch.distributed.checkpoint``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        options: CheckpointOptions | None = None,
        **option_overrides: Any,
    ) -> None:
        base = (options or CheckpointOptions()).replace(**option_overrides)
        self.options = base
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        self.storage, read_storage, encryption = open_root(
            root, storage_options, retry=base.retry_policy(), encryption=base.encryption, bound_to=base.encryption_root
        )
        self.metadata, _ = snapshot(dict(metadata or {}), "metadata key")
        self._coord = make_coordinator(process_group)
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        self._io = ThreadPoolExecutor(base.io_threads, thread_name_prefix="shardkeeper-io")
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-save")
        self._stager = Stager()
        self._plans = PlanCache()
        self._gate = StagingGate()
        ctx = ManagerContext(self.storage, read_storage, self._coord, base, self._io, encryption)
        codecs = CodecState(
            incremental=base.incremental,
            compression=base.compression,
            level=base.compression_level,
            encrypted=encryption is not None,
        )
        self._saver = SaveRunner(ctx, codecs=codecs, stager=self._stager, plans=self._plans, gate=self._gate)
        self._restorer = Restorer(ctx)
        self._ctx = ctx
        self._pending: SaveHandle | None = None
        self._seq = 0  # every rank numbers its saves alike: the keys a save's ranks meet under
        self._closed = False
        at_exit.track(self)

    @property
    def last_restore_stats(self) -> RestoreStats | None:
        """What the last restore attempt that succeeded on this rank read (keys, bytes)."""
        return self._restorer.last_stats

    # -- save --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        async_save: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Stage ``state`` and return; write and commit in the background (see ``async_save``).

        A save started while the previous one still writes first waits for it (that wait
        counts as stall), and raises the previous save's failure if nobody has seen it yet.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        self._wait_pending(raise_error=True)
        refused = self._saver.refusal(step)
        if refused is not None:  # it still takes its turn in the protocol (no rank waits for it)
            seq, self._seq = self._seq, self._seq + 1
            self._pending = self._saver.submit_refused(self._bg, step, seq, refused, owner=self)
            raise refused
        synchronous = not (self.options.async_save if async_save is None else async_save)
        job = self._saver.prepare(
            step,
            self._seq,
            state,
            sync=synchronous,
            defaults=self.metadata,
            metadata=metadata,
            retention=self.retention,
        )
        self._seq += 1
        stall_s = 0.0
        try:
            handle = self._pending = self._saver.submit(self._bg, job, owner=self)
            handle.stall_s = stall_s = time.perf_counter() - t0
            metrics.record(metrics.STALL_SECONDS, stall_s, rank=self.rank, step=step)
            log.info(
                "rank %d step %d: staged %d chunks, %d bytes in %.3f s (stall)",
                self.rank,
                step,
                len(job.plan.items),
                job.plan.nbytes,
                stall_s,
            )
        finally:
            job.start.give(stall_s)  # the writer starts once save() is done with its own work
        if synchronous:
            handle.wait()
        return handle

    def _wait_pending(self, *, raise_error: bool) -> None:
        """Wait for the pending save. A Ctrl-C during the wait propagates at once (the save
        goes on; the handle stays pending, so the next call and the exit still wait for it)."""
        p = self._pending
        if p is None:
            return
        futures_wait([p._future])
        if not raise_error:  # keep the handle: its failure reaches the next save() or wait()
            return
        self._pending = None
        err = p._undelivered_error()
        if err is not None:
            raise err

    def _finish_at_exit(self) -> str | None:
        """At interpreter exit (``at_exit``): wait for the pending save; describe its failure
        if nobody has seen it."""
        p = self._pending
        if p is None or self._closed:
            return None
        futures_wait([p._future])
        err = p._undelivered_error()
        if err is None:
            return None
        return (
            f"the save of step {p.step} under {self.storage.url} (rank {self.rank}) failed at exit "
            f"and was not committed: {type(err).__name__}: {err}"
        )

    # -- what is committed; delete -----------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (reads and validates every manifest of the root: to ask
        about one step or the newest, ``is_committed`` and ``latest_step`` read one)."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None; manifests are validated newest first only until
        one validates."""
        return newest_committed(self.storage)

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed under the root (its manifest exists and validates)."""
        return is_committed(self.storage, step)

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (None: the newest committed): its leaves (keys,
        kinds, shapes, dtypes), world size and metadata, without reading any tensor data."""
        self._check_open()
        if step is None:
            step = newest_committed(self.storage)
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.storage.url} (rank {self.rank})")
        return load_manifest(self._ctx.read_storage, step)  # authenticated when encrypted

    def step_url(self, step: int) -> str:
        """Where ``step``'s directory lives (a path or URL), for messages and other tools."""
        return self.storage.describe(step_dir(step))

    def delete(self, step: int) -> bool:
        """Delete committed ``step`` with retention's guarantees; True if it is gone.

        Call it on every rank (a collective); the coordinator deletes. This manager's pending
        save is waited for first (its failure stays for the next ``wait()``), so it never races
        the deletion; a commit of another process that references ``step`` keeps the files it
        needs (``pending.py``). Never deletes the newest committed step, nor files that another
        retained step references (returns False for the newest: ask again later). A step that
        is not committed counts as gone.
        """
        self._check_open()
        self._wait_pending(raise_error=False)
        return deletion.delete_step(self._ctx, step)

    # -- restore -----------------------------------------------------------------------------
    def restore(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        only: str | Sequence[str] | None = None,
        *,
        strict: bool = True,
        per_rank: str | None = None,
        cast_dtypes: bool = False,
        optional: str | Sequence[str] | None = None,
    ) -> int:
        """Restore ``state`` in place from ``step`` (None: the newest committed); return the step.

        ``only`` takes key patterns (``"model/*"``) for a partial restore; ``optional`` takes
        patterns of target keys that may be absent from the checkpoint (``"rng/*"`` when
        restoring a checkpoint another framework wrote): those keep their values, silently.
        A stateful object gets ``load_state_dict`` only when some of its keys were restored,
        and only after every read succeeded.
        When the newest step turns out damaged, the previous committed one is restored
        instead, with a warning: it rewrites every key the damaged step's attempt wrote, or
        the restore fails naming the keys it cannot rewrite. When the storage fails (after its
        retries), the error is raised, since the step may be intact. An error raised after
        reads wrote into ``state`` says that it is partly restored.
        A :class:`~shardkeeper.core.progress.ProgressTarget` entry (an adapter's ``progress``) is
        handed the restored step's progress, read from its manifest (any framework's layout),
        when ``only`` selects ``progress/``.
        """
        self._check_open()
        rest, targets = split_targets(state)
        policy = per_rank or self.options.per_rank
        if policy not in PER_RANK_POLICIES:
            raise ValueError(f"per_rank={policy!r}; choose one of {', '.join(PER_RANK_POLICIES)}")
        patterns = [only] if isinstance(only, str) else (list(only) if only else None)
        optional_patterns = [optional] if isinstance(optional, str) else list(optional or [])
        self._wait_pending(raise_error=False)
        restored = self._restorer.restore(
            rest,
            step,
            patterns,
            strict=strict,
            per_rank=policy,
            cast=cast_dtypes,
            optional=optional_patterns,
            stacklevel=2,
        )
        merge_back(state, rest)
        if targets and (not patterns or any(_selects_progress(p) for p in patterns)):
            manifest = self._restorer.last_manifest  # the restored step's, read by the restore
            assert manifest is not None and manifest.step == restored
            progress = read_progress(manifest)
            for target in targets.values():
                target.load_progress(progress)
        return restored

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_staged(self) -> None:
        """Block until the pending save has copied the state (``staging="overlap"``).

        Call it before changing saved tensors in place outside ``optimizer.step()`` (EMA
        updates, manual edits, ``load_state_dict``). Cheap when nothing is being staged.
        """
        self._gate.wait()

    @property
    def staging_waits(self) -> int:
        """How many times an optimizer step or ``wait_staged()`` waited for overlapped staging."""
        return self._gate.waits

    def wait(self) -> None:
        """Block until the pending save is committed; raise its failure if not yet seen."""
        self._wait_pending(raise_error=True)

    def close(self) -> None:
        """Wait for the pending save (raising its failure if not yet seen), then release the
        threads. Idempotent. A Ctrl-C during the wait propagates at once and leaves the manager
        open: the save goes on and is still waited for at exit."""
        if self._closed:
            return
        try:
            self.wait()
        except Exception:
            self._shutdown()
            raise
        self._shutdown()

    def _shutdown(self) -> None:
        self._gate.close()
        self._closed = True
        at_exit.untrack(self)
        self._bg.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self.storage.url} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            return  # Ctrl-C / SystemExit: propagate at once; the exit still waits for the save
        self.close()

    def __del__(self) -> None:
        p = getattr(self, "_pending", None)
        if p is not None and not getattr(self, "_closed", True):
            warnings.warn(
                f"CheckpointManager for {self.storage.url} was garbage-collected with a save of "
                f"step {p.step} never waited for; call mgr.wait() or mgr.close()",
                ResourceWarning,
                stacklevel=1,
            )


__all__ = ["CheckpointManager", "CheckpointOptions", "SaveHandle"]
