"""A persist process whose trainer is gone and that has nothing left to save ends at once:
when its trainer ends before the first save (while the persist processes may still be meeting
on a job store that goes with the job), and when the trainer dies with a forked child alive
that inherited its end of the channel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkeeper.core import CheckpointManager

from .._launch import DIST_DIR, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # (a zombie of ours is gone for this purpose)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after ``seconds`` (killed then, so that no test leaves them)."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@pytest.mark.parametrize("mode", ["plain", "kill"])
def test_persist_processes_end_with_a_job_that_ends_before_its_first_save(tmp_path: Path, mode: str) -> None:
    root = str(tmp_path / "root")
    res = run_workers(2, "persist_orphan_worker.py", root, mode, timeout_s=120)
    assert (res.returncode == 0) == (mode == "plain"), res.stdout[-4000:]
    pids = [int(Path(f"{root}.pid.{r}").read_text()) for r in range(2)]
    assert all(pids), pids
    assert _gone_within(pids, 15) == [], f"persist processes outlived a {mode} job's end by 15 s"
    assert not Path(root, "step-000000000001").exists()


def test_a_forked_child_does_not_keep_a_dead_trainers_persist_process(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    log = tmp_path / "log"
    with open(log, "w") as out:  # (a file, not a pipe: the child and the persist process inherit it)
        cmd = [sys.executable, str(DIST_DIR / "persist_orphan_worker.py"), root, "fork"]
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-4000:]
    child = int(Path(f"{root}.child").read_text())
    try:
        pid = int(Path(f"{root}.pid.0").read_text())
        assert _gone_within([pid], 15) == [], "a forked child kept its dead trainer's persist process alive"
    finally:
        _gone_within([child], 0)
    with CheckpointManager(root) as mgr:  # the save handed over before the kill is committed
        assert mgr.latest_step() == 1
