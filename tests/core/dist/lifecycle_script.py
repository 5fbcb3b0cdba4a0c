"""A user's script, run as its own interpreter (plain ``python``, not through worker_main: the
interpreter's own exit is what is tested).

    lifecycle_script.py unclosed ROOT NBYTES [exit]   # save, never close; end normally/raise/exit(3)
    lifecycle_script.py failing ROOT                  # a save that fails, never waited for
    lifecycle_script.py interrupt ROOT HOW            # Ctrl-C while waiting (HOW: handle, sync, ...)
    lifecycle_script.py slow_at_exit ROOT             # end while a slow save writes
    lifecycle_script.py refused ROOT                  # save a step twice (1 or 2 ranks)

Prints one JSON line per result on stdout (``RESULT {...}``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, CommitConflictError
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.wrapper import StorageWrapper

SLOW_CLOSE_S = 3.0


def result(**kv: object) -> None:
    print("RESULT " + json.dumps(kv), flush=True)


class _SlowWriter:
    def __init__(self, inner: object) -> None:
        self.inner = inner

    def write(self, data: object) -> None:
        self.inner.write(data)  # type: ignore[attr-defined]

    def close(self) -> None:
        time.sleep(SLOW_CLOSE_S)
        self.inner.close()  # type: ignore[attr-defined]

    def abort(self) -> None:
        self.inner.abort()  # type: ignore[attr-defined]


class SlowStorage(StorageWrapper):
    """A local root whose shard files take SLOW_CLOSE_S to close: a save that runs for a while."""

    def open_writer(self, path: str) -> object:  # type: ignore[override]
        return _SlowWriter(self.inner.open_writer(path))


def unclosed(root: str, nbytes: int, how: str) -> None:
    atexit.register(lambda: result(atexit_ran=True))
    mgr = CheckpointManager(root)
    g = torch.Generator().manual_seed(nbytes)
    state = {"w": torch.randn(max(1, nbytes // 4), generator=g), "step": 7}
    mgr.save(1, state)
    result(saved=True)
    if how == "raise":
        raise RuntimeError("training crashed after the save")
    if how == "exit":
        sys.exit(3)


def failing(root: str) -> None:
    atexit.register(lambda: result(atexit_ran=True))
    # the root lies under a regular file: every shard file fails to open
    open(root, "w").close()
    mgr = CheckpointManager(os.path.join(root, "run"))
    mgr.save(4, {"w": torch.zeros(8)})
    result(saved=True)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT raises KeyboardInterrupt however the test run was started: a shell's background
    job starts with SIGINT ignored, and Python then installs no handler for it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt(root: str, how: str) -> None:
    _ctrl_c_as_in_a_terminal()
    mgr = CheckpointManager(SlowStorage(open_storage(root)))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        if how == "sync":
            mgr.save(1, {"w": torch.ones(16)}, async_save=False)
        else:
            handle = mgr.save(1, {"w": torch.ones(16)})
            if how == "handle":
                handle.wait()
            elif how == "mgr":
                mgr.wait()
            elif how == "close":
                mgr.close()
            elif how == "with":
                with mgr:
                    time.sleep(10)  # Ctrl-C arrives in the body; __exit__ must not wait
    except KeyboardInterrupt:
        result(interrupted=True, after_s=time.monotonic() - t0)
        return
    result(interrupted=False, after_s=time.monotonic() - t0)


def slow_at_exit(root: str) -> None:
    """A save still writing when the script ends (the test sends Ctrl-C during the exit's wait)."""
    _ctrl_c_as_in_a_terminal()
    mgr = CheckpointManager(SlowStorage(open_storage(root)))
    mgr.save(1, {"w": torch.ones(16)})
    result(saved=True)


def refused(root: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(1024)}, async_save=False)
    before = sorted(os.listdir(os.path.join(root, "step-000000000001", "data")))
    t0 = time.monotonic()
    try:
        mgr.save(1, {"w": torch.zeros(1024)})
    except CommitConflictError as e:
        message = str(e)
    else:
        message = ""
    took = time.monotonic() - t0
    after = sorted(os.listdir(os.path.join(root, "step-000000000001", "data")))
    mgr.save(2, {"w": torch.full((1024,), 2.0)}, async_save=False)  # the protocol is still in step
    restored = {"w": torch.empty(1024)}
    step = mgr.restore(restored)
    mgr.close()
    out = {
        "rank": rank,
        "message": message,
        "took_s": took,
        "files_unchanged": before == after,
        "restored_step": step,
        "restored_ok": bool(torch.equal(restored["w"], torch.full((1024,), 2.0))),
    }
    with open(os.path.join(os.path.dirname(root), f"refused-r{rank}.json"), "w") as f:
        json.dump(out, f)  # ranks' stdout interleave under torchrun
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "unclosed":
        unclosed(root, int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "normal")
    elif mode == "failing":
        failing(root)
    elif mode == "interrupt":
        interrupt(root, sys.argv[3])
    elif mode == "slow_at_exit":
        slow_at_exit(root)
    elif mode == "refused":
        refused(root)
    else:
        raise SystemExit(f"unknown mode {mode}")
