"""``writer="process"`` across ranks: the persist processes write and commit among themselves,
and a save whose ``save()`` returned commits even when a trainer is killed right after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks

from .._launch import run_workers

pytestmark = pytest.mark.timeout(600)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_back_to_back_saves_by_persist_processes(tmp_path: Path) -> None:
    res = run_workers(2, "persist_worker.py", str(tmp_path), "saves", str(tmp_path / "root"))
    assert res.returncode == 0, res.stdout[-4000:]
    assert_checks(read_checks(*(tmp_path / f"saves.r{r}.json" for r in range(2)), output=res.stdout))


def test_a_killed_persist_process_fails_its_save_on_every_rank_at_once(tmp_path: Path) -> None:
    res = run_workers(2, "persist_worker.py", str(tmp_path), "persist-kill", str(tmp_path / "root"))
    assert res.returncode == 0, res.stdout[-4000:]
    assert_checks(read_checks(*(tmp_path / f"persist-kill.r{r}.json" for r in range(2)), output=res.stdout))


def test_ranks_that_pass_different_writers_are_refused(tmp_path: Path) -> None:
    res = run_workers(2, "persist_worker.py", str(tmp_path), "mixed", str(tmp_path / "root"))
    assert res.returncode == 0, res.stdout[-4000:]
    assert_checks(read_checks(*(tmp_path / f"mixed.r{r}.json" for r in range(2)), output=res.stdout))


@pytest.mark.parametrize("victim", [0, 1])
def test_a_trainer_killed_after_save_returned_loses_nothing(tmp_path: Path, victim: int) -> None:
    """Rank ``victim``'s trainer SIGKILLs itself right after ``save(3)`` returns; torchrun tears
    the other down and exits (its store goes with it). The persist processes still commit step
    3, exit on their own, and a fresh trainer restores step 3 bit for bit."""
    root = str(tmp_path / "root")
    env = {"SHARDKEEPER_TEST_KILL_RANK": str(victim), "SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    res = run_workers(2, "persist_worker.py", str(tmp_path), "kill", root, env=env)
    assert res.returncode != 0, res.stdout[-4000:]  # the victim died
    pids = [int(Path(f"{root}.pid.{r}").read_text()) for r in range(2)]
    res = run_workers(2, "persist_worker.py", str(tmp_path), "resume", root, env=env)
    assert res.returncode == 0, res.stdout[-4000:]
    assert_checks(read_checks(*(tmp_path / f"resume.r{r}.json" for r in range(2)), output=res.stdout))
    assert all(_pid_gone(p) for p in pids if p), "a persist process outlived its trainer's last save"
    assert not list((tmp_path / "locks").glob("*.lock")), "a lock file was left behind"
