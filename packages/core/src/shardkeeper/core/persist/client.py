"""``writer="process"``: a ``SaveRunner`` whose saves a persist process writes and commits.

The trainer keeps what must run in its interpreter: the refusal of a step, flattening,
planning and the staging copy (into shared memory, ``save/shared.py``), and, with overlapped
staging, the deferred copy. Before ``save()`` returns, the save is handed over: its lock taken
(``locks.py``) and its plan, spans and metadata sent to the rank's persist process
(``worker.py``), which does the rest. From then on the save no longer depends on the trainer:
a trainer killed after ``save()`` returned leaves a save that commits all the same (with
``staging="overlap"``, once ``handle.staged()``: the deferred copy needs the trainer). The
handle's background thread only waits for the outcome.

The persist process starts with the manager, in a session of its own (the first save waits
until it is ready: it has met the other ranks' persist processes), and is told to close with
the manager; one that dies fails the save in hand (naming the rank, the step and how it
ended), and the next save starts a new one. With a node-local tier and several ranks, every
persist process ends after a save that did not commit (``worker.py``), and every rank's next
save starts a new one, met in a namespace named by that save (``_fresh``): a new tier group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardkeeper.core import metrics
from shardkeeper.core.codec import CodecState
from shardkeeper.core.commit.protocol import Phase
from shardkeeper.core.errors import CheckpointError, CheckpointSaveError, PersistChannelClosed
from shardkeeper.core.persist import locks
from shardkeeper.core.persist.channel import add_counted, error_record, rebuilt, recv, send
from shardkeeper.core.persist.spawn import OUTCOME_SLACK_S, ended_early, how_ended, no_outcome, not_ready, spawn
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.save.handle import SaveHandle
from shardkeeper.core.save.hooks import SaveHooks
from shardkeeper.core.save.job import SaveJob
from shardkeeper.core.save.overlap import StagingGate
from shardkeeper.core.save.plan import PlanCache
from shardkeeper.core.save.runner import SaveRunner
from shardkeeper.core.save.shared import SharedBuffers
from shardkeeper.core.save.stage import Stager

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 30.0


class PersistRunner(SaveRunner):
    """A manager's save protocol with its writer in a persist process (module doc)."""

    stage_always = True

    def __init__(
        self,
        ctx: ManagerContext,
        *,
        codecs: CodecState,
        stager: Stager,
        plans: PlanCache,
        gate: StagingGate,
        hooks: SaveHooks,
        spec: PersistSpec,
        buffers: SharedBuffers,
    ) -> None:
        super().__init__(ctx, codecs=codecs, stager=stager, plans=plans, gate=gate, hooks=hooks)
        self._spec = self._now = spec  # the manager's spec; that of the running process (its namespace)
        self._fresh = False  # the next process starts a new generation of the tiers' persist processes
        self._leaving: list[subprocess.Popen[bytes]] = []  # processes that end on their own
        self._buffers = buffers
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._buffer_sent = 0  # the generation of shared buffer the process has mapped
        self._plan_ids: dict[int, int] = {}  # id(plan token) -> the id the process knows it by
        self._tokens: list[object] = []  # keeps each token alive while its id is in use
        self._handed: set[int] = set()  # seqs already sent
        self._send_lock = threading.Lock()
        self._prepared_at = 0.0
        self._owner = os.getpid()  # a forked child inherits the channel, never the persist process
        self._start()  # now, so that it has met the other ranks' before the first save is handed over
        self._lock_path: Path | None = None  # the lock file of the last save handed over

    @property
    def lock_namespace(self) -> str:
        return self._spec.namespace

    # -- the persist process ------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The persist process's pid; None once it ended (a new one starts at the next save)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self, seq: int = 0, entry: str | None = None) -> socket.socket:
        """A new persist process (running ``entry`` instead of the spec's when given)."""
        if self._fresh:  # (the old generation's store may still be up: its address key is not reused)
            self._now = dataclasses.replace(self._spec, namespace=f"{self._spec.namespace}/gen{seq}")
            self._fresh = False
        self._proc, ours = spawn(self._now if entry is None else dataclasses.replace(self._now, entry=entry))
        self._sock, self._ready, self._buffer_sent = ours, False, 0
        self._plan_ids.clear()
        self._tokens.clear()
        return ours

    def _channel(self, seq: int) -> socket.socket:
        """The channel to a persist process that is ready: it has rebuilt the writer and met
        the other ranks' persist processes, so a save handed over needs no trainer (nor the
        job's store) any more. Starts one (for save ``seq``) when there is none, it died, or
        a new generation is due."""
        if self._sock is None or self._fresh or (self._proc is not None and self._proc.poll() is not None):
            self._drop()
            self._start(seq)
        assert self._sock is not None
        if not self._ready:
            self._await_ready(self._sock)
        return self._sock

    def _await_ready(self, sock: socket.socket) -> None:
        timeout_s = max(60.0, self.ctx.settings.commit_timeout_s)
        sock.settimeout(timeout_s)
        try:
            kind, payload, fds = recv(sock)
        except (TimeoutError, PersistChannelClosed) as e:  # (closed: its start crashed, or it was killed)
            how = self.ended() if isinstance(e, PersistChannelClosed) else None
            self._drop()
            raise not_ready(self.ctx.rank, timeout_s, how) from None
        finally:
            if self._sock is not None:
                sock.settimeout(None)
        for fd in fds:
            os.close(fd)
        if kind == "failed":
            self._drop()
            raise rebuilt(payload)
        self._ready = kind == "ready"

    def _drop(self) -> None:
        """Forget a persist process that is gone (or to be replaced; one of an old generation
        ends on its own once the other ranks read its last outcome: waited for at ``close``)."""
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        if self._proc is not None and self._proc.poll() is None:
            if self._fresh:
                self._leaving.append(self._proc)
            else:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    @property
    def handed_over(self) -> bool:  # (this manager handed a save over to a persist process)
        return self._lock_path is not None

    def ask(self, kind: str, payload: Any) -> dict[str, Any] | None:
        """Send ``kind`` to the persist process, return its answer of that kind (None: no process,
        or a forked child); one that is gone is dropped, raising ``PersistChannelClosed(how)``."""
        with self._send_lock:
            sock = self._sock
            if sock is None or self._fresh or os.getpid() != self._owner:
                return None
            try:
                send(sock, kind, payload)
                return self.receive(sock, kind)
            except (OSError, PersistChannelClosed) as e:
                how = self.ended()
                self._drop()
                raise PersistChannelClosed(how) from e

    def ended(self) -> str:
        """How the persist process ended, in words ("never started" when there was none)."""
        return how_ended(self._proc)

    # -- handing a save over ------------------------------------------------------------------
    def prepare(self, step: int, seq: int, state: Any, **kwargs: Any) -> SaveJob:
        self._prepared_at = time.perf_counter()
        return super().prepare(step, seq, state, **kwargs)

    def _plan_message(self, job: SaveJob) -> tuple[int, Any]:
        token = job.plan.token
        if token is not None and id(token) in self._plan_ids:
            return self._plan_ids[id(token)], None
        plan_id = len(self._tokens) + 1
        if token is not None:
            self._plan_ids[id(token)] = plan_id
            self._tokens.append(token)
        else:
            self._tokens.append(object())
        # What travels is the plan's structure: no token, no source tensor, no cache of the trainer's.
        return plan_id, (dataclasses.replace(job.plan, token=None, sources=None, memo={}), job.groups)

    def _hand_over(self, job: SaveJob) -> None:
        """Send ``job`` to the persist process with its lock (which it then holds)."""
        ctx = self.ctx
        placed = self._stager.allocation
        with self._send_lock:
            sock = self._channel(job.seq)
            if placed is not None and self._buffers.generation != self._buffer_sent and self._buffers.fd is not None:
                send(sock, "buffer", self._buffers.nbytes, (self._buffers.fd,))
                self._buffer_sent = self._buffers.generation
            plan_id, plan = self._plan_message(job)
            fd, path = locks.hold(ctx.storage.url, self._spec.namespace, ctx.rank, job.step)
            try:
                msg = {
                    "step": job.step,
                    "seq": job.seq,
                    "attempt": job.attempt,
                    "plan_id": plan_id,
                    "plan": plan,
                    "offset": placed[1] if placed is not None else 0,
                    "spans": [[None if sp is None else [sp[1], sp[2]] for sp in row] for row in job.spans],
                    "objects": job.objects,
                    "extended": job.extended,
                    "metadata": job.metadata,
                    "sync": job.sync,
                    "replicas": job.replicas,
                    "retention": job.retention,
                    "stall_s": time.perf_counter() - self._prepared_at,
                    "lock": str(path),
                }
                send(sock, "save", msg, (fd,))
            except BaseException:
                locks.release(fd, path)
                raise
            os.close(fd)  # the persist process holds the lock now
            self._handed.add(job.seq)
            self._lock_path = path

    def submit(self, bg: ThreadPoolExecutor, job: SaveJob, *, owner: object) -> SaveHandle:
        if job.deferred is None:
            try:
                self._hand_over(job)
            except OSError as e:
                raise CheckpointSaveError(
                    f"save of step {job.step} on rank {self.ctx.rank}: its persist process could not take it "
                    f"({type(e).__name__}: {e}; {self.ended()}); the step was not committed. The next save starts "
                    f"a new persist process",
                    step=job.step,
                ) from e
        return super().submit(bg, job, owner=owner)

    def submit_refused(
        self, bg: ThreadPoolExecutor, step: int, seq: int, err: CheckpointError, *, owner: object
    ) -> SaveHandle:
        if self.ctx.world_size > 1:
            self._take_turn(step, seq, err, Phase.CHECK)
        return super().submit_refused(bg, step, seq, err, owner=owner)

    def _take_turn(self, step: int, seq: int, err: BaseException, phase: Phase) -> None:
        """A save that fails before it is handed over still takes its turn, in the process."""
        with self._send_lock:
            try:
                send(
                    self._channel(seq),
                    "fail",
                    {"step": step, "seq": seq, "phase": phase.value, "error": error_record(err)},
                )
            except (OSError, CheckpointError) as e:
                log.warning(
                    "step %d, rank %d: its persist process could not take a failed save's turn: %s",
                    step,
                    self.ctx.rank,
                    e,
                )
                return
            self._handed.add(seq)

    # -- background thread --------------------------------------------------------------------
    def run_refused(self, step: int, seq: int, err: CheckpointError, phase: Phase = Phase.CHECK) -> None:
        if seq in self._handed:
            self._outcome(step, seq)  # (the refusal is this save's error, whatever the turn's outcome)
        raise err

    def run(self, job: SaveJob) -> None:
        """Wait for the outcome of ``job`` from the persist process (after the deferred copy,
        then handing it over, when staging was overlapped)."""
        job.start.wait()
        t0 = time.perf_counter()
        if job.seq not in self._handed:
            try:
                if job.deferred is not None and job.staged is not None:
                    self._gate.run(job.deferred, job.staged)
            except BaseException as e:
                self._take_turn(job.step, job.seq, e, Phase.STAGE)
                self._outcome(job.step, job.seq)
                raise CheckpointSaveError(
                    f"save of step {job.step} failed on rank {self.ctx.rank} in phase {Phase.STAGE}: "
                    f"{type(e).__name__}: {e}; the checkpoint was not committed",
                    step=job.step,
                ) from e
            self._hand_over(job)
        error = self._outcome(job.step, job.seq)
        if error is not None:
            raise rebuilt(error)
        self._order.committed(job.step)
        metrics.record(metrics.LAST_COMMITTED_STEP, job.step, rank=self.ctx.rank, step=job.step)
        metrics.record(metrics.SAVE_SECONDS, time.perf_counter() - t0, rank=self.ctx.rank, step=job.step)

    def receive(
        self, sock: socket.socket, want: str, seq: int | None = None, by: float | None = None
    ) -> dict[str, Any]:
        """The persist process's next ``want`` message (``"outcome"``: that of save ``seq``) by
        ``by`` (else ``TimeoutError``); what comes before it is taken as it comes: ``ready``, a
        start that ``failed`` (raised), the outcome of a save whose wait was given up."""
        while True:
            kind, payload, fds = recv(sock, by)
            for fd in fds:
                os.close(fd)
            if kind == "ready":
                self._ready = True
            elif kind == "failed":
                self._drop()
                raise rebuilt(payload)
            elif kind == "outcome":
                add_counted(payload.get("counted") or [])
                self._fresh = self._fresh or bool(payload.get("ends"))
                if want == "outcome" and payload["seq"] == seq:
                    return payload  # type: ignore[no-any-return]
            elif kind == want:
                return payload  # type: ignore[no-any-return]

    def _outcome(self, step: int, seq: int) -> dict[str, Any] | None:
        """The persist process's outcome of save ``seq``: its error record, or None."""
        self._handed.discard(seq)
        sock = self._sock
        try:
            if sock is None:
                raise PersistChannelClosed("no persist process")
            bound = 2 * self.ctx.settings.commit_timeout_s + OUTCOME_SLACK_S
            return self.receive(sock, "outcome", seq, time.monotonic() + bound)["error"]  # type: ignore[no-any-return]
        except TimeoutError:
            raise no_outcome(step, self.ctx.rank, self.ctx.storage.url, self.pid, bound) from None
        except PersistChannelClosed as e:
            how, ended = self.ended(), self._fresh  # (ended: after an outcome that said it ends)
            with self._send_lock:
                self._drop()
            if self._lock_path is not None:  # its process is gone: its lock is free, its file stale
                locks.clear_if_free(self._lock_path)
            err = ended_early(step, self.ctx.rank, self.ctx.storage.url, how)
            if self.ctx.world_size > 1 and self._spec.tiers is not None and not ended:
                self._lost_tiers(step, seq, err)
            elif self.ctx.world_size > 1:  # a new process takes the lost save's turn: no rank waits for its report
                self._take_turn(step, seq, err, Phase.WRITE)
                self._handed.discard(seq)  # (its outcome is not waited for: the next save's read skips it)
            raise err from e

    def _lost_tiers(self, step: int, seq: int, err: BaseException) -> None:
        """A tiers' persist process died: the other ranks' end after this save, whose turn a
        process without tiers takes in the lost one's generation (rank 0's store went with it:
        no turn). The next save starts a new generation."""
        if self.ctx.rank != 0:
            with self._send_lock:
                self._start(seq, entry="shardkeeper.core.persist.worker")
            self._take_turn(step, seq, err, Phase.WRITE)
            self._handed.discard(seq)  # (it ends after its turn: its outcome is not waited for)
        self._fresh = True

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self, wait_s: float = _CLOSE_WAIT_S) -> None:
        """Tell the persist process to end once the saves it holds are done, and wait up to
        ``wait_s`` for it (0: not at all, as at exit). Never killed: a save it was handed
        commits whatever the trainer does. Nothing in a forked child: the process is the
        parent's."""
        if os.getpid() != self._owner:
            return
        with self._send_lock:
            sock, proc = self._sock, self._proc
            self._sock = self._proc = None
            leaving, self._leaving = self._leaving, []
        if sock is not None:
            try:
                send(sock, "close")
            except OSError:
                pass
            sock.close()
        deadline = time.monotonic() + wait_s
        for p in [*leaving, *([proc] if proc is not None else [])] if wait_s > 0 else []:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "rank %d: its persist process (pid %d) is still finishing a save after %.0f s; it ends on its own",
                    self.ctx.rank,
                    p.pid,
                    wait_s,
                )
        self._buffers.close()


__all__ = ["PersistRunner"]
