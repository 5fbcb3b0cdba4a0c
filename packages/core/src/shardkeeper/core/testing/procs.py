"""End a launched process and everything under it, torchrun workers included.

torchrun starts each worker in a session of its own, so killing the launcher's process group
leaves the workers running (and holding the launcher's output pipe). These helpers walk
``/proc`` for the whole tree instead. Linux only; used by the tests and the benchmarks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid``, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each PID that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen[Any], *, dump_stacks: bool = False, grace_s: float = 0.0) -> None:
    """Kill ``proc`` and every process under it, whatever session or group they are in.

    ``dump_stacks`` first sends the descendants SIGABRT, on which Python's faulthandler (when
    enabled, e.g. by ``PYTHONFAULTHANDLER=1``) prints every thread's stack: a hang shows where
    each rank stood. ``grace_s`` > 0 first asks the whole tree to stop with SIGTERM.
    """
    tree = descendants(proc.pid)
    if dump_stacks and tree:
        signal_all(tree, signal.SIGABRT)
        time.sleep(2.0)
    if grace_s > 0:
        signal_all([proc.pid, *tree], signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    signal_all([proc.pid, *tree, *descendants(proc.pid)], signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


__all__ = ["descendants", "kill_tree", "signal_all"]
