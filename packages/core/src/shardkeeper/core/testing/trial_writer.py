"""The writer of a kill trial (``campaign``): the trial drawn, the process forked to save its
steps until it is killed, and what the parent reads back (the steps it saw committed, and how
it ended)."""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardkeeper.core.testing.kill_points import KillingStorage, kill_self
from shardkeeper.core.testing.trial_checks import Summary, deterministic_state
from shardkeeper.core.testing.writer_options import DEFAULTS, TIER_DEFAULTS

if TYPE_CHECKING:
    from shardkeeper.core.storage.base import Storage


@dataclass
class Trial:
    """One kill trial, as the campaign drew it: where the writer dies, and the steps it saves."""

    index: int
    point: str
    n: int
    after_bytes: int
    delay_s: float
    first_step: int
    steps: int
    async_save: bool


def _write_steps(
    root: str | os.PathLike[str] | Storage,
    options: dict[str, Any],
    manager_options: dict[str, Any],
    t: Trial,
    tensor_bytes: int,
    wfd: int,
    local: str | None = None,
) -> None:
    """Save trial ``t``'s steps through a manager whose storage (the local tier's, with
    ``local``) kills this process at the trial's point; each step seen committed goes to ``wfd``."""
    from shardkeeper.core import CheckpointManager
    from shardkeeper.core.storage import open_storage

    own = {**DEFAULTS, "async_save": t.async_save}  # the campaign's; manager_options override them
    if local is None:
        storage = KillingStorage(open_storage(root, **options), t.point, t.n, t.after_bytes)
        mgr = CheckpointManager(storage, **{**own, **manager_options})
    else:  # the kills land in the local tier; every other step is uploaded to ``root`` meanwhile
        killing = KillingStorage(open_storage(local), t.point, t.n, t.after_bytes)
        mgr = CheckpointManager(
            root,
            storage_options=options,
            local=killing,
            **{**own, **TIER_DEFAULTS, **manager_options},
        )
    for i, step in enumerate(range(t.first_step, t.first_step + t.steps)):
        state = deterministic_state(step, tensor_bytes)
        if t.point == "staging" and i == t.n - 1:
            threading.Timer(random.uniform(0.0, 0.003), kill_self).start()
        mgr.save(step, state).wait()
        os.write(wfd, f"{step}\n".encode())
    mgr.close()


def fork_writer(
    root: str | os.PathLike[str] | Storage,
    options: dict[str, Any],
    manager_options: dict[str, Any],
    t: Trial,
    tensor_bytes: int,
    local: str | None,
    seed: int,
) -> tuple[int, int]:
    """Fork the writer of trial ``t``; returns its pid and the read end of a pipe on which it
    writes each step it saw committed, a line each, and ``!`` and its error if it fails."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 0
        try:
            os.close(rfd)
            random.seed(seed * 7919 + t.index)
            _write_steps(root, options, manager_options, t, tensor_bytes, wfd, local)
        except BaseException as e:
            traceback.print_exc()
            with contextlib.suppress(OSError):  # the parent reports it with the trial
                os.write(wfd, f"!{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
            code = 3
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, rfd


def read_until_exit(pid: int, rfd: int, timeout_s: float, t: Trial, s: Summary) -> tuple[list[str], int]:
    """The lines writer ``pid`` wrote to ``rfd`` until it closed it, and its wait status; a
    writer still running after ``timeout_s`` is killed, and ``s`` records that."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([rfd], [], [], 0.5)
        if ready:
            chunk = os.read(rfd, 4096)
            if not chunk:
                break
            out += chunk
    else:
        kill_quietly(pid)
        s.failures.append(f"trial {t.index}: the writer did not finish in {timeout_s} s")
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace").splitlines(), status


def record_exit(s: Summary, t: Trial, status: int, said: list[str]) -> bool:
    """Count in ``s`` how the writer of trial ``t`` ended (killed at its point, completed, or
    failed with what it ``said``); returns whether it completed."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        s.killed += 1
        s.points_hit[t.point] += 1
        return False
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        s.completed += 1
        return True
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    why = said[0] if said else "see its traceback on stderr"
    s.writer_errors.append(f"trial {t.index} ({t.point}): the writer failed (exit status {code}): {why}")
    return False


def kill_quietly(pid: int) -> None:
    """SIGKILL process ``pid`` if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


__all__ = ["Trial", "fork_writer", "kill_quietly", "read_until_exit", "record_exit"]
