"""Starting a persist process (``worker.py``) and saying how one ended, for its trainer
(``client.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from shardkeeper.core.persist.channel import send
from shardkeeper.core.persist.spec import PersistSpec


def spawn(spec: PersistSpec) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A persist process running ``spec.entry``, in a session of its own, and the trainer's end
    of its channel (the spec already sent)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env["CUDA_VISIBLE_DEVICES"] = ""  # it reads host memory only: no CUDA context of its own
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", spec.entry, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # out of reach of a teardown of the trainer's process group
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # it prints nothing; its log goes to the trainer's stderr
            env=env,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    send(ours, "hello", spec)
    return proc, ours


def how_ended(proc: subprocess.Popen[bytes] | None) -> str:
    """How ``proc`` ended, in words ("never started" when None)."""
    if proc is None:
        return "never started"
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return f"pid {proc.pid}, still running but its channel closed"
    if code < 0:
        return f"pid {proc.pid}, killed by {signal.Signals(-code).name}"
    return f"pid {proc.pid}, exit status {code}"


__all__ = ["how_ended", "spawn"]
