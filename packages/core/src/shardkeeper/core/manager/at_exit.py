"""Saves in flight are committed before the interpreter exits.

A script that calls ``mgr.save(...)`` and ends without ``close()`` (what every ``torch.save``
user writes) must not lose its last checkpoint. At a normal exit the interpreter first runs
``threading``'s exit hooks, in reverse order of registration, and one of them, registered
when ``concurrent.futures`` is imported, refuses new work to every thread pool; only then are
threads joined and ``atexit`` handlers run. A background save still submitting its file
writes would fail there. So the first manager registers a ``threading`` exit hook (later
than the thread pools' own, so it runs before it) that waits for every live manager's
pending save.

A save that fails there is reported on stderr (an ERROR naming the root and the step) and
the process exits with status 1 once the ``atexit`` handlers have run: a lost checkpoint is
never a silent exit 0. A save whose failure the caller already saw (``wait()`` raised) is not
reported twice. A Ctrl-C during the wait abandons it: an ERROR says so and the process ends
at once with status 130 (the uncommitted files are invisible; ``shardkeeper gc`` removes them).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Any, Protocol

log = logging.getLogger("shardkeeper.core")


class _Finishing(Protocol):
    def _finish_at_exit(self) -> str | None:
        """Wait for the pending save; a line describing its failure, if one is unseen."""
        ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(manager: _Finishing) -> None:
    """Wait for ``manager``'s pending save at exit. Kept weakly: a manager with a save in
    flight is referenced by its background thread until the save ends (``save/runner.py``), so a
    script that drops it still has its save waited for."""
    global _registered
    with _lock:
        _live.add(manager)
        if not _registered:
            # Registered after concurrent.futures.thread (the manager's thread pools imported
            # it), hence called before its hook that stops the pools.
            threading._register_atexit(_at_thread_shutdown)  # type: ignore[attr-defined]
            # Also at the atexit stage, for runners that leave through atexit handlers and
            # os._exit without the thread shutdown (a no-op when the hook above ran).
            atexit.register(_at_interpreter_exit)
            _registered = True


def untrack(manager: _Finishing) -> None:
    with _lock:
        _live.discard(manager)


def _at_thread_shutdown() -> None:
    if _finish_all():
        atexit.register(_exit_with_failure)


def _at_interpreter_exit() -> None:
    if _finish_all():
        _exit_with_failure()


#: The process whose managers these are: a child forked from it (a DataLoader's worker, a
#: ``multiprocessing`` fork) inherits the list but none of the saves, and must neither wait for
#: them (they would never end there) nor end their writers.
_owner_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _owner_pid
    with _lock:
        _live.clear()
    _owner_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _finish_all() -> bool:
    """Wait for every live manager's pending save; report the failures; True if any."""
    if os.getpid() != _owner_pid:  # (a fork the hook did not see: not this process's saves)
        return False
    with _lock:
        managers = list(_live)
    failures = []
    for m in managers:
        try:
            line = m._finish_at_exit()
        except Exception as e:  # noqa: BLE001 - at exit: report every manager, never stop
            line = f"{type(e).__name__}: {e}"
        except KeyboardInterrupt:  # a second Ctrl-C: abandon the wait, and leave at once
            _abandon(m)
        if line:
            failures.append(line)
    for line in failures:
        # stderr always (a script may never have configured logging); the log too where it goes
        # somewhere (with no handler, logging's last resort would print the line a second time)
        if log.hasHandlers():
            log.error("shardkeeper: %s", line)
        print(f"ERROR shardkeeper: {line}", file=sys.stderr, flush=True)
    return bool(failures)


def _abandon(manager: Any) -> None:
    """Ctrl-C while waiting at exit: say what is abandoned and end the process now, with the
    status of an interrupt (the interpreter's teardown with a save still running could abort)."""
    p = getattr(manager, "_pending", None)
    what = f"the save of step {p.step} under {manager.storage.url}" if p is not None else "a pending save"
    options = getattr(manager, "options", None)
    if getattr(options, "writer", None) == "process":
        fate = "its persist process goes on and commits it unless that fails (list the root to see)"
    else:
        fate = (
            "it is abandoned: not committed unless its commit had already happened (list the root to see); "
            "`shardkeeper gc` removes the files of an uncommitted save"
        )
    print(
        f"ERROR shardkeeper: interrupted at exit while waiting for {what}; {fate}",
        file=sys.stderr,
        flush=True,
    )
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001, S110
        pass
    os._exit(130)


def _exit_with_failure() -> None:
    """Run the remaining ``atexit`` handlers, then end the process with status 1 (registered
    during thread shutdown, it is the first handler called; at the atexit stage it is called
    directly)."""
    atexit.unregister(_exit_with_failure)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed stream: nothing left to flush
            pass
    os._exit(1)


__all__ = ["track", "untrack"]
