"""The persist processes (``writer="process"``) of a trainer, for the adapters' resume tests.

A worker calls ``note_persist_processes(checks, what, options, out)`` once its saves ran: it
checks that the manager was made with ``writer="process"`` and that persist processes run
beside this trainer (children of this process running ``shardkeeper.core.persist.worker``),
and appends their pids to ``out``. Once the launch has ended, the test calls
``assert_persist_processes_gone(out)``: every noted pid must have exited (each exits when its
trainer is gone and it has nothing left to commit).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

MODULE = "shardkeeper.core.persist.worker"


def persist_children(parent: int | None = None) -> list[int]:
    """Pids of the live persist processes whose parent is ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it exited while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        if ppid == parent and MODULE.encode() in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def persist_check(what: str) -> str:
    """The name of the check ``note_persist_processes(checks, what, ...)`` records."""
    return f"{what}: the saves went through persist processes (writer='process')"


def note_persist_processes(checks: Any, what: str, options: Any, out: str | os.PathLike[str]) -> list[int]:
    """Check (in ``checks``, a ``tests.checks.Checks``) that ``options`` (a manager's
    ``CheckpointOptions``) say ``writer="process"`` and that persist processes serve this
    trainer; append their pids to the file ``out``, one a line."""
    pids = persist_children()
    checks.check(
        persist_check(what),
        options.writer == "process" and len(pids) > 0,
        f"writer={options.writer!r}, persist processes of pid {os.getpid()}: {pids}",
    )
    with open(out, "a") as f:
        f.writelines(f"{p}\n" for p in pids)
    return pids


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_persist_processes_gone(*files: str | os.PathLike[str], grace_s: float = 10.0) -> None:
    """Every pid noted in ``files`` (one per rank) has exited (within ``grace_s``: a persist
    process whose trainer is gone exits once it has nothing left to commit); each file noted one."""
    noted = {str(f): [int(line) for line in Path(f).read_text().split()] if Path(f).exists() else [] for f in files}
    assert all(noted.values()), f"a rank noted no persist process: {noted}"
    pids = sorted({p for ps in noted.values() for p in ps})
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"persist processes {left} (of {pids}) outlived their trainers by {grace_s} s"
