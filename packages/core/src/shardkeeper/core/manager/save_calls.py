"""``CheckpointManager``'s save side, a base class of it: ``save()``, the pending save it leaves
(``wait()``, ``wait_staged()``, ``staging_waits``, the wait at interpreter exit), a
preemption's final upload (``upload_newest``) and the check that the manager is open, which
every call makes. The manager (``manager.py``) sets the attributes annotated here."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from shardkeeper.core import metrics
from shardkeeper.core.config.arguments import check_state, check_step
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.manager.schedule import SaveSchedule
from shardkeeper.core.save.handle import SaveHandle
from shardkeeper.core.save.overlap import StagingGate
from shardkeeper.core.save.runner import SaveRunner
from shardkeeper.core.storage import Storage
from shardkeeper.core.tiers.strategy import TierStrategy

log = logging.getLogger(__name__)


class SaveCalls:
    """The save side of ``CheckpointManager``."""

    options: CheckpointOptions
    retention: RetentionPolicy
    metadata: dict[str, Any]
    storage: Storage
    rank: int
    _saver: SaveRunner
    _bg: ThreadPoolExecutor
    _gate: StagingGate
    _strategy: TierStrategy
    _schedule: SaveSchedule
    _pending: SaveHandle | None
    _seq: int
    """Every rank numbers its saves alike: the keys a save's ranks meet under."""
    _closed: bool

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
        step = check_step("save", step)
        check_state("save", state)
        t0 = time.perf_counter()
        self._wait_pending(raise_error=True)
        refused = self._saver.refusal(step)
        if refused is not None:  # it still takes its turn in the protocol (no rank waits for it)
            seq, self._seq = self._seq, self._seq + 1
            self._pending = self._saver.submit_refused(self._bg, step, seq, refused, owner=self)
            self._pending._waited = True  # its outcome is the refusal, raised right here
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
        self._schedule.mark(step)  # should_save: nothing at or below it
        stall_s = 0.0
        try:
            handle = self._pending = self._saver.submit(self._bg, job, owner=self)
            handle._owner = f"CheckpointManager for {self._strategy.url} (rank {self.rank})"  # not a node's directory
            handle.stall_s = stall_s = time.perf_counter() - t0
            metrics.record(metrics.STALL_SECONDS, stall_s, rank=self.rank, step=step)
            msg = "rank %d step %d: staged %d chunks, %d bytes in %.3f s (stall)"
            log.info(msg, self.rank, step, len(job.plan.items), job.plan.nbytes, stall_s)
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
        p._waited = True
        if not raise_error:  # keep the handle: its failure reaches the next save() or wait()
            return
        self._pending = None
        err = p._undelivered_error()
        if err is not None:
            raise err

    def _finish_at_exit(self) -> str | None:
        """At interpreter exit (``at_exit``): wait for the pending save, then end the writer's
        persist process if it has one; describe the save's failure if nobody has seen it."""
        try:
            return self._pending_at_exit()
        finally:
            if not self._closed:
                self._saver.close(wait_s=0)  # (a persist process finishes what it holds on its own)

    def _pending_at_exit(self) -> str | None:
        p = self._pending
        if p is None or self._closed:
            return None
        futures_wait([p._future])
        p._waited = True
        err = p._undelivered_error()
        if err is None:
            return None
        return (
            f"the save of step {p.step} under {self.storage.url} (rank {self.rank}) failed at exit "
            f"and was not committed: {type(err).__name__}: {err}"
        )

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

    @property
    def pending_save(self) -> SaveHandle | None:
        """The last save started, until ``wait()``, ``close()`` or the next ``save()`` delivered
        its outcome (it may have ended meanwhile: ``done()``); None when there is none."""
        return self._pending

    @property
    def newest_committed_save(self) -> int | None:
        """The newest step this manager's saves committed (None: none yet), without reading
        the root (``latest_step()`` reads it: other writers may have committed there too)."""
        return self._saver.newest_committed_save

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        """With a local tier, every rank alike (``PreemptionGuard``'s exit): upload the newest
        step committed locally to the persistent root, whatever ``persist_every`` says, unless
        an upload has it, and wait up to ``timeout_s`` for it. Returns that step (None: this
        manager committed none) and whether it is committed there by now; ``(None, False)``
        with one tier. Raises when nothing can upload it (``writer="process"``: the persist
        process ended), and while a save is still running (``wait()`` for it first)."""
        self._check_open()
        p = self._pending
        if p is not None and not p.done():
            raise CheckpointError(
                f"upload_newest(): the save of step {p.step} under {self.storage.url} is still running (rank "
                f"{self.rank}); wait() for it first, then upload the newest committed step"
            )
        return self._strategy.upload_newest(timeout_s)

    def wait(self) -> None:
        """Block until the pending save (the last one started) is committed or has failed.

        Raises that save's failure (``CheckpointSaveError`` and the like) unless a
        ``SaveHandle.wait()`` already raised it; returns at once when nothing is pending. A
        Ctrl-C during the wait propagates at once: the save goes on in the background, stays
        pending (the next ``wait()``/``save()``/``close()`` waits for it again) and is waited
        for at interpreter exit. Collective in effect: the commit needs every rank's save.
        """
        self._wait_pending(raise_error=True)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self.storage.url} is closed")


__all__ = ["SaveCalls"]
