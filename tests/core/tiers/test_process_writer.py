"""The node-local tier with ``writer="process"`` (``tiers/process_writer.py``): the tier
tests' key scenarios across three simulated nodes with persist processes, and a trainer
killed right after ``save()`` returned whose step the restarted trainer restores from the
local tier."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replicas_and_erasure_across_nodes_with_persist_processes(tmp_path: Path) -> None:
    """The thread writer's runs of these scenarios: ``test_tiers.py``, ``test_erasure_nodes.py``
    (``tier_writer_worker.py thread`` runs this one's with the thread writer)."""
    res = run_workers(3, "tier_writer_worker.py", str(tmp_path), "process", timeout_s=240)
    assert res.returncode == 0, res.stdout[-8000:]
    assert_checks(read_checks(*(tmp_path / f"checks-r{r}.json" for r in range(3)), output=res.stdout))


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_trainer_killed_after_save_returned_commits_in_the_local_tier(tmp_path: Path) -> None:
    """Rank 1's trainer SIGKILLs itself right after ``save(3)`` returned (step 3's manifest not
    yet on either node: the persist processes commit it), torchrun tears rank 0's down and
    exits; the persist processes commit, record and upload step 3, then exit, and a fresh
    launch restores it bit for bit from the local tier."""
    env = {"SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    res = run_workers(2, "tier_kill_worker.py", str(tmp_path), "kill", env=env, timeout_s=150)
    assert res.returncode != 0, res.stdout[-4000:]  # rank 1 died
    assert [(tmp_path / f"seen{r}").read_text() for r in range(2)] == ["False", "False"], res.stdout[-4000:]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    res = run_workers(2, "tier_kill_worker.py", str(tmp_path), "resume", env=env, timeout_s=150)
    assert res.returncode == 0, res.stdout[-4000:]
    assert_checks(read_checks(*(tmp_path / f"resume-r{r}.json" for r in range(2)), output=res.stdout))
    assert all(_gone(p) for p in pids), "a persist process outlived its trainer's last save"
    assert not list((tmp_path / "locks").glob("*.lock")), "a lock file was left behind"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_persist_process_fails_one_save_then_the_tiers_go_on(tmp_path: Path, killed: int) -> None:
    """Rank ``killed``'s persist process (rank 0's: the one whose store the others meet on) is
    SIGKILLed during save 2 (two simulated nodes, ``replicas=1``):
    save 2 fails on both ranks at once, save 3 commits on both with fresh persist processes (a
    new tier group), is recorded on both nodes, and a fresh launch restores it bit for bit from
    the local tier after node 1's loss; no persist process or lock file is left."""
    env = {"SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    res = run_workers(2, "tier_persist_kill_worker.py", str(tmp_path), "kill", str(killed), env=env, timeout_s=75)
    assert res.returncode == 0, res.stdout[-8000:]
    assert_checks(read_checks(*(tmp_path / f"kill-r{r}.json" for r in range(2)), output=res.stdout))
    pids = [int(p) for r in range(2) for p in (tmp_path / f"pids{r}").read_text().split()]
    assert all(_gone(p, 10.0) for p in pids if p), "a persist process outlived its manager"
    assert not list((tmp_path / "locks").glob("*.lock")), "a lock file was left behind"
    res = run_workers(2, "tier_persist_kill_worker.py", str(tmp_path), "resume", timeout_s=30)
    assert res.returncode == 0, res.stdout[-8000:]
    assert_checks(read_checks(*(tmp_path / f"resume-r{r}.json" for r in range(2)), output=res.stdout))
