"""Starting a persist process (``worker.py``) and saying how one ended, for its trainer
(``client.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from shardkeeper.core.errors import CheckpointSaveError, CheckpointTimeoutError
from shardkeeper.core.persist.channel import send
from shardkeeper.core.persist.spec import PersistSpec

#: How a persist process runs its module: as ``python -m`` would, without the working directory
#: first on the path (``-m`` puts it before the standard library, so a ``json.py`` there, in a
#: directory others may write, would run in the persist process; ``-P`` would do, from 3.11 on).
_BOOT = (
    "import sys\n"
    "if sys.path[:1] == ['']: del sys.path[0]\n"
    "entry = sys.argv.pop(1)\n"
    "import runpy\n"
    "runpy.run_module(entry, run_name='__main__', alter_sys=True)\n"
)


def spawn(spec: PersistSpec) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A persist process running ``spec.entry``, in a session of its own, and the trainer's end
    of its channel (the spec already sent)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env["CUDA_VISIBLE_DEVICES"] = ""  # it reads host memory only: no CUDA context of its own
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, spec.entry, str(theirs.fileno())],
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


#: Beyond twice ``commit_timeout_s``, how long a trainer waits for its persist process's
#: outcome of a save (as a restore waits for a save's lock, ``persist/locks.py``).
OUTCOME_SLACK_S = 30.0


def ended_early(step: int, rank: int, root: str, how: str) -> CheckpointSaveError:
    """The error of a save whose persist process ended (``how``) before its outcome was known."""
    return CheckpointSaveError(
        f"save of step {step} under {root} on rank {rank}: its persist process ended ({how}) before the save's "
        f"outcome was known; the step may or may not be committed (a restore takes it if its manifest is there, "
        f"else the newest step before it). The next save starts a new persist process",
        step=step,
    )


def not_ready(rank: int, timeout_s: float, how: str | None) -> CheckpointSaveError:
    """The error of a save whose persist process never said it was ready: it ended (``how``),
    or did not meet the other ranks' within ``timeout_s`` (``how`` None)."""
    what = (
        f"ended ({how}) before it was ready"
        if how is not None
        else f"did not meet the other ranks' within {timeout_s:.0f} s (is every rank saving with writer='process', "
        f"and rank 0 alive?)"
    )
    return CheckpointSaveError(
        f"rank {rank}: its persist process {what}; nothing was saved. The next save starts a new persist process",
        step=-1,
    )


def no_outcome(step: int, rank: int, root: str, pid: int | None, waited_s: float) -> CheckpointTimeoutError:
    """The error of a save whose persist process said nothing for ``waited_s`` seconds."""
    who = f"its persist process (pid {pid})" if pid else "its persist process"
    return CheckpointTimeoutError(
        f"save of step {step} under {root} on rank {rank}: {who} gave no outcome within {waited_s:.0f} s "
        f"(2 x commit_timeout_s + {OUTCOME_SLACK_S:.0f} s): it is stopped, hung or starved of CPU. The step may "
        f"or may not be committed (a restore waits for its lock, then takes it if it is). See what it does "
        f"(py-spy dump --pid {pid}) or end it (kill {pid}): the next save then starts a new persist process"
    )


__all__ = ["OUTCOME_SLACK_S", "ended_early", "how_ended", "no_outcome", "not_ready", "spawn"]
