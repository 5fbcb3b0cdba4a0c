"""Opt-in SIGTERM handling for preemptible jobs.

::

    guard = PreemptionGuard(mgr, grace_s=60).install()     # main thread, every rank
    for step in ...:
        train_step()
        if step % 100 == 0:
            mgr.save(step, state)      # the regular schedule
        if guard.check():              # collective: True on every rank once any rank got SIGTERM
            guard.final_save(step, state)  # saves (unless step is saved already), records, exits 143

On SIGTERM the handler only marks the job preempted and starts the grace clock.
``final_save(step, state)`` is the final save at a safe point and then ``exit()``; it never
returns. A step this manager already committed or is saving (the signal landed on a step the
schedule saves too) is not saved again, which ``mgr.save`` would refuse: the save in flight
is waited for instead. Whatever the save does (it raises, or outlasts the grace period), the
record is written and the process exits with the exit code. ``exit()`` alone (after the
loop's own final ``mgr.save``) lets the pending save commit if it can within what is left of
``grace_s``. Past the grace period a watchdog thread exits the process whatever the loop is
doing. Either way a save that did not commit is abandoned: its manifest was never written, so
it is not visible, and gc removes its files later. Rank 0 records the outcome in
``<root>/preempted.json`` (``{"last_committed_step", "abandoned_step", "signal_time",
"exit_time"}``, and after ``final_save`` ``"final_save": {"step", "committed", "saved",
"error"}``: whether the step is committed, whether this call saved it or found it saved or
in flight, and the save's error), logs it and sets the ``checkpoint_last_committed_step``
metric. The exit code is 128 + SIGTERM = 143.

With a local tier (``local=``) the final save commits on the nodes first, and a node that is
replaced after the preemption loses it: so ``exit()`` then uploads the newest step committed
locally to the persistent root (whatever ``persist_every`` says; every rank, as in any upload)
and waits for it within the grace period: ``mgr.upload_newest``, which runs it where the
uploads run (with ``writer="process"``, in the persist process). The record goes to the
persistent root, with ``last_persisted_step`` (the persistent root's newest: what a job on new
nodes restores), ``last_local_step`` (rank 0's node's newest) and ``final_upload``
(``{"step", "done"}``, and ``"error"`` when the upload could not run: a persist process that
ended); every rank logs a step it did not upload.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any, NoReturn

from shardkeeper.core import metrics
from shardkeeper.core.commit.committed import newest_committed
from shardkeeper.core.errors import RankLostError
from shardkeeper.core.format.layout import PREEMPTED_NAME
from shardkeeper.core.format.untrusted import loads_untrusted

log = logging.getLogger(__name__)

RECORD_NAME = PREEMPTED_NAME
#: A preemption record is a few hundred bytes; a larger file under that name is not one.
_MAX_RECORD_BYTES = 1 << 20
EXIT_CODE = 128 + signal.SIGTERM


class PreemptionGuard:
    """Turns SIGTERM into a clean stop of a training loop that saves with ``mgr``."""

    def __init__(self, mgr: Any, *, grace_s: float = 60.0, exit_code: int = EXIT_CODE) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.mgr = mgr
        self.grace_s = grace_s
        self.exit_code = exit_code
        self._event = threading.Event()
        self._signal_time: float | None = None
        self._exit_lock = threading.Lock()
        self._previous: Any = None
        self._final_upload: dict[str, Any] | None = None  # with a local tier: the record's "final_upload"
        self._final: dict[str, Any] | None = None  # what final_save did (the record's "final_save")
        self._final_handle: Any = None  # the save whose outcome the final save is

    @property
    def preempted(self) -> bool:
        """True once this process got SIGTERM (local; use ``check()`` in a process group)."""
        return self._event.is_set()

    def install(self) -> PreemptionGuard:
        """Install the SIGTERM handler (call from the main thread)."""
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            return
        self._signal_time = time.time()
        self._event.set()
        log.warning("rank %d: SIGTERM, preempted; exiting within %.1f s", self.mgr.rank, self.grace_s)
        threading.Thread(target=self._watchdog, name="shardkeeper-preemption", daemon=True).start()

    def check(self) -> bool:
        """Whether any rank was preempted (a collective when the manager spans several ranks)."""
        flag = int(self._event.is_set())
        if getattr(self.mgr, "world_size", 1) > 1:
            try:
                flag = self.mgr.agree(flag, "max")
            except RankLostError as e:  # a rank is gone (preempted first, or crashed): stop as preempted
                log.warning("rank %d: %s; stopping as preempted", self.mgr.rank, e)
                flag = 1
        if flag and not self._event.is_set():  # another rank got the signal: same clock here
            self._signal_time = time.time()
            self._event.set()
            threading.Thread(target=self._watchdog, name="shardkeeper-preemption", daemon=True).start()
        return bool(flag)

    def remaining_s(self) -> float:
        if self._signal_time is None:
            return self.grace_s
        return max(0.0, self._signal_time + self.grace_s - time.time())

    def _watchdog(self) -> None:
        time.sleep(self.remaining_s())
        self._finish(abandon=True)

    def final_save(self, step: int, state: Mapping[str, Any], **save_kwargs: Any) -> NoReturn:
        """The final save of ``step`` at a safe point, then ``exit()``: never returns (every
        rank, after ``check()`` said True).

        A step this manager committed or is saving (the schedule's own save of this step) is
        not saved again: ``exit()`` waits for the save in flight within the grace period. Any
        other step is saved with ``mgr.save(step, state, **save_kwargs)``. Whatever that does
        (raises: a step another writer committed, a step below the newest, a failing storage;
        or runs past the grace period), the record is written and the process exits with
        ``exit_code``: the scheduler sees a preemption, never a crash."""
        self._final = {"step": step, "committed": False, "saved": False, "error": None}
        try:
            pending = self.mgr.pending_save
            if pending is not None and pending.step == step:
                self._final_handle = pending  # in flight (or committed meanwhile): waited for
            elif self.mgr.newest_committed_save != step:
                self._final["saved"] = True
                self._final_handle = self.mgr.save(step, state, **save_kwargs)
            else:
                self._final["committed"] = True  # committed by this manager already
        except Exception as e:  # noqa: BLE001 - recorded; the exit below always runs
            self._final["error"] = f"{type(e).__name__}: {e}"
            log.warning("rank %d: the final save of step %d failed: %s", self.mgr.rank, step, self._final["error"])
        finally:
            self.exit()

    def exit(self) -> NoReturn:
        """Wait for the pending save within the grace period, record, and exit (whatever the
        wait or the upload raise)."""
        abandon = False
        try:
            pending = self.mgr.pending_save
            if pending is not None:
                try:
                    pending.wait(timeout_s=self.remaining_s())
                except Exception as e:  # noqa: BLE001 - a failed or late save is abandoned
                    log.warning(
                        "rank %d: the save of step %d did not commit in time: %s", self.mgr.rank, pending.step, e
                    )
                    abandon = not pending.done()
            if self.mgr.tiering is not None and not abandon:
                self._upload_final()
        except BaseException as e:  # noqa: BLE001 - the record and the exit status come first
            log.warning("rank %d: preempted, and waiting for the last save failed: %s", self.mgr.rank, e)
        finally:
            self._finish(abandon=abandon)
        self._exit_lock.acquire()  # the watchdog is exiting the process: never return to the loop
        raise AssertionError("unreachable")  # pragma: no cover

    def _upload_final(self) -> None:
        """With a local tier, every rank: ``mgr.upload_newest`` (the newest step committed
        locally, the final save, uploaded unless an upload has it, wherever the uploads run)
        within the grace period, less a moment to write the record (the watchdog ends a wait
        that overruns: the record then names this node's newest step, not uploaded)."""
        self._final_upload = {"step": None, "done": False, "running": True}
        try:
            step, done = self.mgr.upload_newest(self.remaining_s() - min(1.0, self.grace_s / 10))
            self._final_upload = {"step": step, "done": bool(done)}
        except Exception as e:  # noqa: BLE001 - exit anyway; the record says it was not uploaded, and why
            self._final_upload = {"step": None, "done": False, "error": f"{type(e).__name__}: {e}"}
            log.warning("rank %d: the final upload to the persistent root failed: %s", self.mgr.rank, e)

    def _tier_record(self, tiers: Any) -> dict[str, Any]:
        """What a local tier adds to the record: the newest step of each tier and whether the
        final upload finished (said in the log too when it did not)."""
        out: dict[str, Any] = {"last_persisted_step": None, "last_local_step": None}
        for name, storage in (("last_persisted_step", tiers.persistent.storage), ("last_local_step", self.mgr.storage)):
            try:
                out[name] = newest_committed(storage)
            except Exception as e:  # noqa: BLE001 - the record is best effort
                log.warning("could not list the committed steps of %s while exiting: %s", storage.url, e)
        final = dict(self._final_upload or {"step": None, "done": False})
        if final.pop("running", False) or "error" in final:  # (cut off, or failed: this node's newest is not up)
            final["step"] = out["last_local_step"]
        out["final_upload"] = final
        step, error = final["step"], final.get("error")
        if step is not None and not final["done"]:
            log.warning(
                "rank %d: step %d was not uploaded to %s %s: it is committed in the local tier only; a job "
                "restarted on these nodes restores it, one on new nodes restores %s",
                self.mgr.rank,
                step,
                tiers.persistent.storage.url,
                f"(the final upload failed: {error})" if error else f"within the grace period ({self.grace_s:.1f} s)",
                "nothing (no step is persisted)"
                if out["last_persisted_step"] is None
                else f"step {out['last_persisted_step']}",
            )
        return out

    def _finish(self, *, abandon: bool) -> None:
        if not self._exit_lock.acquire(blocking=False):
            return  # the other path is already exiting
        try:
            pending = self.mgr.pending_save
            abandoned = pending.step if abandon and pending is not None and not pending.done() else None
            last = None
            try:
                last = newest_committed(self.mgr.storage)  # in the grace period: one manifest read
            except Exception as e:  # noqa: BLE001 - the record is best effort; exit anyway
                log.warning("could not list committed steps while exiting: %s", e)
            tiers = self.mgr.tiering
            record: dict[str, Any] = {
                "last_committed_step": last,
                "abandoned_step": abandoned,
                "signal_time": self._signal_time,
                "exit_time": time.time(),
                "rank": self.mgr.rank,
            }
            if self._final is not None:
                record["final_save"] = self._final_outcome()
            if tiers is not None:
                record.update(self._tier_record(tiers))
                newest = [s for s in (last, record["last_persisted_step"]) if s is not None]
                record["last_committed_step"] = last = max(newest) if newest else None
            if last is not None:
                metrics.record(metrics.LAST_COMMITTED_STEP, last, rank=self.mgr.rank, step=last)
            log.warning(
                "rank %d: preempted; last committed step %s%s",
                self.mgr.rank,
                last,
                f", save of step {abandoned} abandoned" if abandoned is not None else "",
                extra={"preemption": record},
            )
            if self.mgr.rank == 0:
                try:
                    root = tiers.persistent.storage if tiers is not None else self.mgr.storage  # not a node's own
                    root.put(RECORD_NAME, json.dumps(record).encode())
                except Exception as e:  # noqa: BLE001
                    log.warning("could not write %s: %s", RECORD_NAME, e)
        finally:
            logging.shutdown()
            os._exit(self.exit_code)

    def _final_outcome(self) -> dict[str, Any]:
        """The record's ``final_save``: whether its save committed (by now: one still running
        at the end of the grace period is abandoned), and its error."""
        out = dict(self._final or {})
        handle = self._final_handle
        if handle is not None and out.get("error") is None:
            try:
                handle.wait(timeout_s=0)
                out["committed"] = True
            except Exception as e:  # noqa: BLE001 - failed, or still running: not committed
                out["committed"] = False
                out["error"] = f"{type(e).__name__}: {e}"
        return out


def read_record(storage: Any) -> dict[str, Any] | None:
    """The last preemption record under a root, if any."""
    try:
        return dict(loads_untrusted(storage.read_bytes(RECORD_NAME), max_bytes=_MAX_RECORD_BYTES))
    except Exception:  # noqa: BLE001
        return None


__all__ = ["EXIT_CODE", "RECORD_NAME", "PreemptionGuard", "read_record"]
