"""The persist process: one per rank of a manager with ``writer="process"``, started by its
trainer with the manager (as ``python -m shardkeeper.core.persist.worker FD`` would, without
the working directory on the path: ``spawn.py``).

It rebuilds the manager's writer from the ``PersistSpec`` it is sent first (the root opened
the same way, the same codecs, a coordinator of its own: ``meeting.py``), then
runs each save it is handed: the bytes are in the staging buffer it maps (``save/shared.py``),
the plan and spans come over the channel (``channel.py``). It hashes, encodes, writes, reports,
commits (rank 0), applies retention and answers the outcome; nothing of it runs in the
trainer's interpreter. It holds each save's lock (``locks.py``) until the outcome is known.
With a node-local tier the writer is the tiers' (``tiers/process_writer.py``, which runs this
process with its own ``opener``): it also sends replicas or parity to the other nodes'
persist processes, records the commit on every node, uploads to the persistent root and
applies retention per node; the trainer asks about the uploads over the channel (``uploads``),
and has a preemption's final upload run there.

It runs at a lower CPU priority than its trainer (``NICENESS``) and in a session of its own,
so torchrun's teardown of its workers' process groups does not reach it, and it outlives its
trainer by design: once the channel closes without a
``close`` message (the trainer died), it finishes the save in hand, takes the turn of the
save that will never come (so no other rank waits for it until the timeout), and exits.
With a node-local tier and several ranks it also ends after a save that did not commit
(``ends`` in its outcome): every rank hears that outcome, so every persist process of the
manager ends with it, and the trainers' next save starts fresh ones, which meet anew (a new
tier group), whatever broke the old group (a persist process killed, a rank out of step).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from shardkeeper.core.commit.protocol import COORDINATOR, Failure, Outcome, Phase
from shardkeeper.core.errors import CheckpointSaveError, CoordinatorLostError, PersistChannelClosed
from shardkeeper.core.persist import locks
from shardkeeper.core.persist.channel import counted_since, counters, error_record, rebuilt, recv, send
from shardkeeper.core.persist.meeting import Meeting
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.runtime.context import ManagerContext, open_root
from shardkeeper.core.runtime.coordinator import LocalCoordinator
from shardkeeper.core.save.hooks import OneRoot, SaveHooks
from shardkeeper.core.save.job import SaveJob, Start
from shardkeeper.core.save.recipe import save_runner
from shardkeeper.core.save.shared import map_shared

log = logging.getLogger("shardkeeper.core.persist")


def _coordinator(spec: PersistSpec) -> LocalCoordinator | Meeting:
    if spec.world_size == 1 or spec.store is None:
        return LocalCoordinator()
    opts = spec.options
    return Meeting(spec.store, spec.rank, spec.world_size, spec.namespace, spec.group_ranks, opts.commit_timeout_s)


class Uploads(Protocol):
    """A writer's uploads to a persistent root behind its local tier (``tiers/persist.py``)."""

    persisted: list[int]

    def join(self) -> None: ...

    def wait(self, *, raise_error: bool = True) -> None: ...

    def forget_above(self, newest: int | None) -> None: ...


@dataclass(frozen=True)
class Writer:
    """What a persist process writes with: its context (root, coordinator, codecs), the save's
    hooks, its uploads (None: one root), what to release at its end (``close(ending)``: True
    when it ends after a save that did not commit) and a preemption's final upload
    (``Tiering.upload_newest``; None: one root)."""

    ctx: ManagerContext
    hooks: SaveHooks
    uploads: Uploads | None = None
    close: Callable[[bool], None] = lambda ending: None
    final_upload: Callable[[float], tuple[int | None, bool]] | None = None


def one_root(spec: PersistSpec, coord: Any, io: ThreadPoolExecutor) -> Writer:
    """The writer of a manager without tiers: ``spec.root`` opened as the manager opened it."""
    opts = spec.options
    storage, read, keyed = open_root(
        spec.root,
        spec.storage_options,
        retry=opts.retry_policy(),
        encryption=opts.encryption,
        bound_to=opts.encryption_root,
    )
    ctx = ManagerContext(storage, read, coord, opts, io, keyed)
    return Writer(ctx, OneRoot(ctx))


#: How a persist process opens its writer (``spec``, its coordinator, its I/O threads).
Opener = Callable[[PersistSpec, Any, ThreadPoolExecutor], Writer]


class Worker:
    """The writer of one rank, rebuilt from ``spec`` (by ``opener``)."""

    def __init__(self, spec: PersistSpec, opener: Opener = one_root) -> None:
        opts = spec.options
        self.spec = spec
        self.io = ThreadPoolExecutor(opts.io_threads, thread_name_prefix="shardkeeper-io")
        self.coord = _coordinator(spec)
        if isinstance(self.coord, Meeting):
            self.coord.current()  # met before "ready": a save handed over needs no job store any more
        try:
            writer = opener(spec, self.coord, self.io)
        except BaseException:
            self.io.shutdown(wait=False)
            raise
        self.ctx, self.uploads, self._release = writer.ctx, writer.uploads, writer.close
        self._final_upload = writer.final_upload
        self.runner = save_runner(self.ctx, opts, writer.hooks)
        self.buffer: memoryview | None = None
        self.plans: dict[int, tuple[Any, Any]] = {}  # the trainer's plan id -> (plan, groups)
        self.next_seq = 0
        self.ending = False  # a save did not commit: this process ends once it answered (module doc)

    def serve(self, sock: socket.socket) -> int:
        """Run what the trainer sends until it says ``close`` (0) or is gone (0 as well)."""
        while True:
            try:
                kind, payload, fds = recv(sock)
            except PersistChannelClosed:
                self._orphaned()
                return 0
            if kind == "close":
                return 0
            if kind == "buffer":
                self.buffer = map_shared(fds[0], int(payload))
            elif kind == "save":
                self._save(sock, payload, fds[0] if fds else None)
            elif kind == "fail":
                self._turn(sock, payload)
            elif kind == "uploads":
                self._uploads(sock, payload)
            else:
                log.error("persist process of rank %d: unknown message %r", self.spec.rank, kind)
            if self.ending:
                return 0

    def _job(self, msg: dict[str, Any]) -> SaveJob:
        if msg["plan"] is not None:
            self.plans[msg["plan_id"]] = msg["plan"]
            if len(self.plans) > 4:  # (a few layouts alive at once, as the trainer's stager keeps)
                self.plans.pop(next(iter(self.plans)))
        plan, groups = self.plans[msg["plan_id"]]
        view = self.buffer[msg["offset"] :] if self.buffer is not None else memoryview(b"")
        spans = [[None if sp is None else (view, sp[0], sp[1]) for sp in row] for row in msg["spans"]]
        start = Start()
        start.give(msg["stall_s"])
        return SaveJob(
            msg["step"],
            msg["seq"],
            msg["attempt"],
            plan,
            groups,
            spans,  # type: ignore[arg-type]
            msg["objects"],
            msg["extended"],
            msg["metadata"],
            msg["sync"],
            msg["retention"],
            start,
            replicas=msg.get("replicas"),
        )

    def _save(self, sock: socket.socket, msg: dict[str, Any], lock: int | None) -> None:
        self.next_seq = msg["seq"] + 1
        if lock is not None:
            locks.mark(lock, self.spec.rank, msg["step"])
        t0, before = time.perf_counter(), counters()
        error: dict[str, Any] | None = None
        try:
            self.runner.run(self._job(msg))
        except BaseException as e:  # the save's failure, sent to the trainer
            log.debug("persist process of rank %d: save of step %d failed", self.spec.rank, msg["step"], exc_info=True)
            error = error_record(e)
            if isinstance(e.__cause__, CoordinatorLostError) and isinstance(self.coord, Meeting):
                self.coord.lost()
        finally:
            if lock is not None:
                locks.release(lock, msg["lock"])
            if isinstance(self.coord, Meeting):
                self.coord.seen(msg["seq"])
        grown = counted_since(before)
        self._answer(sock, {"seq": msg["seq"], "error": error, "seconds": time.perf_counter() - t0, "counted": grown})

    def _turn(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        """A save that failed in the trainer before it was handed over still takes its turn."""
        self.next_seq = msg["seq"] + 1
        err = rebuilt(msg["error"])
        error: dict[str, Any] | None = None
        try:
            self.runner.run_refused(msg["step"], msg["seq"], err, Phase(msg["phase"]))
        except BaseException as e:
            error = error_record(e)
        if isinstance(self.coord, Meeting):
            self.coord.seen(msg["seq"])
        self._answer(sock, {"seq": msg["seq"], "error": error, "seconds": 0.0})

    def _uploads(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        """The trainer asks about the uploads (a local tier's): counts them from the step
        ``forget_above`` names when it is given (a restore quarantined the ones above), waits
        for the running one when ``join``, hands over an upload failure nobody has seen when
        ``take_error``, runs a preemption's final upload for up to ``final`` seconds when it
        is given."""
        up, error = self.uploads, None
        if up is not None and "forget_above" in msg:
            up.join()
            up.forget_above(msg["forget_above"])
        final = None if msg.get("final") is None else self._final(float(msg["final"]))
        if up is not None and msg.get("join"):
            up.join()
        if up is not None and msg.get("take_error"):
            try:
                up.wait()
            except BaseException as e:  # the upload's failure, raised by the trainer's wait_persisted
                error = error_record(e)
        answer = {"steps": list(up.persisted) if up is not None else [], "error": error, "final": final}
        try:
            send(sock, "uploads", answer)
        except OSError:
            log.info("persist process of rank %d: trainer gone before the uploads' answer", self.spec.rank)

    def _final(self, timeout_s: float) -> dict[str, Any]:
        """``Writer.final_upload`` within ``timeout_s``: the step, whether it is uploaded, and
        the error that stopped it."""
        step, done, error = None, False, None
        try:
            if self._final_upload is None:
                raise CheckpointSaveError("this persist process has no persistent root to upload to", step=-1)
            step, done = self._final_upload(timeout_s)
        except BaseException as e:  # sent to the trainer, whose guard records the step as not uploaded
            error = error_record(e)
        return {"step": step, "done": done, "error": error}

    def _answer(self, sock: socket.socket, outcome: dict[str, Any]) -> None:
        """Send a save's outcome; with a local tier and several ranks, one that did not commit
        says this process ends (``ends``: the trainer's next save starts a new one)."""
        spec = self.spec
        self.ending = outcome["ends"] = outcome["error"] is not None and spec.tiers is not None and spec.world_size > 1
        try:
            send(sock, "outcome", outcome)
        except OSError:  # the trainer is gone: the save is committed (or not) all the same
            log.info(
                "persist process of rank %d: trainer gone before the outcome of save %d", self.spec.rank, outcome["seq"]
            )

    def _orphaned(self) -> None:
        """The trainer is gone between saves: take the turn of its next save, which will
        never come, so that the other ranks' persist processes do not wait for it."""
        ctx, seq = self.ctx, self.next_seq
        if ctx.world_size == 1:
            return
        err = CheckpointSaveError(
            f"the trainer of rank {ctx.rank} exited before it handed over its next save (save #{seq} of this "
            f"manager); that save cannot be committed",
            step=-1,
        )
        failure = Failure.of(ctx.rank, Phase.WRITE, ctx.storage.url, err)
        try:
            if ctx.rank == COORDINATOR:
                ctx.coord.publish(seq, Outcome(failure))
            else:
                ctx.coord.report(seq, failure)
        except Exception as e:  # noqa: BLE001 - the job is ending; nobody to tell
            log.debug("persist process of rank %d: the turn of save %d: %s", ctx.rank, seq, e)

    def close(self) -> None:
        """The uploads end first (they need rank 0's store), then rank 0 waits for the others."""
        try:
            self._release(self.ending)
        finally:
            if isinstance(self.coord, Meeting):
                self.coord.before_exit()
            self.io.shutdown(wait=True)


#: The persist process's niceness above its trainer's: where CPUs are short, training's own
#: threads (a kernel-launching loop, data loading) run first, and the save takes the rest.
NICENESS = 10


def _watch_trainer(sock: socket.socket, trainer: int, started: threading.Event) -> None:
    """Wait for the trainer's end: its end of the channel closed, or the process ``trainer``
    gone (a child it forked, a DataLoader worker, may hold a copy of its end of the channel
    after it died). Before ``started`` (this process is not ready: no save was handed over)
    end this process at once: meeting the other ranks' persist processes may wait for a job's
    store that went with the job. After, end what the trainer sends (``serve`` reads what it
    sent, then the channel's end: the trainer died)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP)  # (data to read does not wake it)
    try:
        pidfd = os.pidfd_open(trainer)
        poller.register(pidfd, select.POLLIN)
    except OSError:  # (gone already, or a kernel without pidfds: the channel's end alone)
        pass
    poller.poll()
    if not started.is_set():
        log.info("persist process: its trainer ended before its first save; nothing to save")
        os._exit(0)
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def main(argv: list[str], opener: Opener = one_root) -> int:
    """Serve the trainer at the other end of descriptor ``argv[1]`` with ``opener``'s writer."""
    sock = socket.socket(fileno=int(argv[1]))
    started = threading.Event()
    watch = (sock, os.getppid(), started)  # (spawned by its trainer, in a session of its own)
    threading.Thread(target=_watch_trainer, args=watch, daemon=True, name="shardkeeper-watch").start()
    try:
        os.nice(NICENESS)
    except OSError:  # (a sandbox that refuses it: the save runs at the trainer's priority)
        pass
    logging.basicConfig(level=os.environ.get("SHARDKEEPER_PERSIST_LOG", "WARNING").upper())
    try:
        kind, spec, _ = recv(sock)
    except PersistChannelClosed:
        return 0
    try:
        if kind != "hello" or not isinstance(spec, PersistSpec):
            raise CheckpointSaveError(f"the persist process expected its spec first, got {kind!r}", step=-1)
        worker = Worker(spec, opener)
    except BaseException as e:
        log.exception("persist process could not start")
        try:
            send(sock, "failed", error_record(e))
        except OSError:
            pass
        return 1
    started.set()
    try:
        send(sock, "ready", os.getpid())
    except OSError:  # the trainer is gone already: what it handed over is still to be saved
        pass
    try:
        return worker.serve(sock)
    except BaseException:
        log.exception("persist process of rank %d failed", spec.rank)
        return 1
    finally:
        worker.close()


__all__ = ["Worker", "main"]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
