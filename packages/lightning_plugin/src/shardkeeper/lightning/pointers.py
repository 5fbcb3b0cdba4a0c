"""Pointers written once their step is committed (rank 0), never before.

A Lightning path (``last.ckpt``, a top-k file) names a step through its pointer file and the
root's path index (:mod:`shardkeeper.lightning.paths`). Written when the save starts, a pointer
would name a step that a kill, a crash or a failed commit leaves uncommitted, and a resume from
it would find nothing. So a path is *due* until its step's save ends: the save's done-callback
(in the thread that ends it) writes its pointers as soon as the step is committed, and the
caller's side settles at the latest when it learns the outcome (the next save, ``wait()``, the
strategy's teardown, a removal), raising a failure to write there. A failed save's paths are
forgotten: they keep naming what they named. A failure to write stays due (retried at the next
settle) and is reported by the caller: raised on every rank by the plugin's next collective
(the next save, the end of ``fit()``), logged elsewhere, so that rank 0 never raises alone. The pointer file itself is written by
:func:`~shardkeeper.lightning.paths.write_pointer`, the one place that opens it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from shardkeeper.lightning.paths import PathIndex, write_pointer

log = logging.getLogger(__name__)


class DuePointers:
    """Rank 0's paths waiting for their step's commit, and what became of those steps.

    ``lock`` also guards the path index (``index()``), which the done-callback updates from
    the core's thread: every other use of the index holds it too."""

    def __init__(self, root: str, index: Callable[[], PathIndex]) -> None:
        self.root = root
        self.index = index
        self.lock = threading.RLock()
        self._due: dict[str, int] = {}
        self._outcomes: dict[int, bool] = {}  # step -> committed (True) or failed (False)

    def add(self, path: str, step: int) -> None:
        """``path`` is to name ``step`` once ``step`` is committed."""
        with self.lock:
            self._due[path] = step

    def committed(self, step: int) -> None:
        """``step`` is committed already (not saved by this process: the step it resumed from)."""
        self._mark(step, None)

    def watch(self, handle: Any) -> None:
        """Write the paths due for ``handle``'s step as soon as its save ends."""
        handle.add_done_callback(self._on_done)

    def take(self, path: str) -> bool:
        """Forget ``path`` (Lightning removes it); whether it was due."""
        with self.lock:
            return self._due.pop(path, None) is not None

    def settle(self, handle: Any = None) -> str | None:
        """Caller's side: take ``handle``'s outcome when its save has ended (the core calls
        back at once, here), then write every due pointer whose step is committed. Returns a
        failure to write, described (those paths stay due), for the caller to report."""
        if handle is not None and handle.done():
            handle.add_done_callback(self._mark)
        try:
            self._write()
        except Exception as e:
            return f"the pointers of committed steps under {self.root} were not written: {type(e).__name__}: {e}"
        return None

    def _on_done(self, step: int, error: BaseException | None) -> None:
        self._mark(step, error)
        failed = self.settle()
        if failed is not None:  # retried by the caller's next settle(), which reports it
            log.warning("%s (retried)", failed)

    def _mark(self, step: int, error: BaseException | None) -> None:
        with self.lock:
            self._outcomes[step] = error is None

    def _write(self) -> None:
        with self.lock:
            for p, s in list(self._due.items()):
                if self._outcomes.get(s) is False:
                    del self._due[p]
                    log.warning("%s still names what it named: the save of step %d under %s failed", p, s, self.root)
            ready = {p: s for p, s in self._due.items() if self._outcomes.get(s)}
            if not ready:
                return
            idx = self.index()
            for p, s in ready.items():
                write_pointer(p, self.root, s)
                idx.set(p, s)
                del self._due[p]
            idx.flush()


__all__ = ["DuePointers"]
