"""``SaveHandle``: one save in flight, as the caller holds it.

``wait()`` raises the save's failure on every call; the manager raises it from its next
``save()``/``wait()``/``close()`` (or reports it at exit, ``manager/at_exit.py``) only if no
``wait()`` has delivered it yet. A save whose handle is collected with nobody having waited
for it (neither through the handle nor through its manager) warns (``UnwaitedSaveWarning``):
the handle, not the manager, since a handle still held is a wait still to come (in
``CheckpointManager(root).save(...).wait()`` the manager goes first, while its handle waits).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from shardkeeper.core.errors import CheckpointTimeoutError

log = logging.getLogger(__name__)


class UnwaitedSaveWarning(RuntimeWarning):
    """A manager was garbage-collected with a save nobody waited for: whether it committed
    was never checked. A ``RuntimeWarning``, so Python shows it by default."""


@dataclass
class SaveHandle:
    """One save, as ``CheckpointManager.save()`` returns it.

    ``step``: the step saved; ``stall_s``: how long ``save()`` blocked the caller;
    ``done()`` / ``staged()`` ask without blocking; ``wait()`` blocks until the save is
    committed and raises its failure. Waiting is optional per save: the manager's next
    ``save()``, ``wait()`` or ``close()`` waits for it too (and the interpreter's exit does).
    """

    step: int
    _future: Future[None]
    stall_s: float = 0.0
    deferred_bytes: int = 0
    """Bytes whose staging copy ``staging="overlap"`` deferred to the background."""
    _staged: threading.Event | None = field(default=None, repr=False)
    _delivered: bool = field(default=False, repr=False)
    _waited: bool = field(default=False, repr=False)  # someone waited for the outcome
    _owner: str = field(default="", repr=False)  # its manager, as the warning names it ("": no warning)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def done(self) -> bool:
        """True once the save is committed or has failed (never blocks)."""
        return self._future.done()

    def staged(self) -> bool:
        """True once the state is copied (always, unless ``staging="overlap"`` deferred it)."""
        return self._staged is None or self._staged.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until this save is written and committed (on every rank: the commit needs
        every rank's part), or has failed.

        Raises the save's failure, ``CheckpointSaveError`` and the like, on every call (not
        once; the manager then no longer raises it). ``timeout_s``: give up waiting after that
        long with ``CheckpointTimeoutError`` (the save goes on). A Ctrl-C
        (``KeyboardInterrupt``) or ``SystemExit`` during the wait propagates at once; the save
        goes on in the background and is still waited for when the interpreter exits.
        """
        try:
            self._future.result(timeout=timeout_s)
            self._waited = True
        except BaseException as e:
            if self._is_outcome(e):  # the save's own failure
                self._waited = True
                self._deliver()
                raise
            if isinstance(e, FutureTimeout):  # the wait ran out, the save goes on
                raise CheckpointTimeoutError(f"save of step {self.step} still running after {timeout_s} s") from None
            raise  # an interrupt of the wait (Ctrl-C, SystemExit)

    def add_done_callback(self, fn: Callable[[int, BaseException | None], None]) -> None:
        """Call ``fn(step, error)`` once this save has ended: ``error`` is None when it
        committed, else its failure, which stays undelivered (``wait()`` and the manager still
        raise it). For work that must follow the commit closely, such as an adapter's pointer
        files. ``fn`` runs in the thread that ends the save, or at once in this thread when it
        has ended (so calling this again on an ended save runs ``fn`` here); it must not wait for
        the manager, and what it raises is logged, never the save's failure."""

        def call(f: Future[None]) -> None:
            err = CancelledError() if f.cancelled() else f.exception()
            try:
                fn(self.step, err)
            except Exception:
                log.exception("a done-callback of the save of step %d failed", self.step)

        self._future.add_done_callback(call)

    def __del__(self) -> None:
        """Warn (``UnwaitedSaveWarning``) when nobody waited for this save's outcome, neither
        through this handle nor through its manager: whether it committed or failed was never
        checked (a failure is reported nowhere else)."""
        if self._waited or not self._owner:
            return
        try:
            warnings.warn(
                f"{self._owner}: step {self.step} never waited for (its save's handle was garbage-collected), so "
                f"whether it committed or failed was never checked; call mgr.wait() (or handle.wait()) after "
                f"save(), or mgr.close()",
                UnwaitedSaveWarning,
                stacklevel=2,
            )
        except Exception:  # noqa: BLE001 - at interpreter teardown warnings may be gone
            pass

    def _is_outcome(self, e: BaseException) -> bool:
        """Is ``e`` the save's own failure (rather than something that interrupted a wait)?"""
        f = self._future
        return f.done() and not f.cancelled() and f.exception() is e

    def _deliver(self) -> None:
        with self._lock:
            self._delivered = True

    def _undelivered_error(self) -> BaseException | None:
        """The save's failure if it failed and nobody has seen it yet (marks it seen)."""
        f = self._future
        if not f.done() or f.cancelled():
            return None
        err = f.exception()
        with self._lock:
            first = not self._delivered
            self._delivered = True
        return err if first else None


__all__ = ["SaveHandle", "UnwaitedSaveWarning"]
