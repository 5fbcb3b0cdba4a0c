"""The two tiers under real concurrency (gloo ranks, each its own local directory: two
simulated nodes): saves issued while uploads run, with the persistent commit made slow on
purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers

WORKER = "tiers_concurrency_worker.py"


def _run(tmp_path: Path, mode: str, nproc: int = 2, timeout_s: float = 180, **cfg: Any) -> list[dict[str, Any]]:
    out = tmp_path / mode
    config = {
        "root": str(tmp_path / "root"),
        "locals": [str(tmp_path / f"node{r}") for r in range(nproc)],
        **cfg,
    }
    res = run_workers(nproc, WORKER, mode, str(out), json.dumps(config), timeout_s=timeout_s)
    assert res.returncode == 0, res.stdout[-6000:]
    checks = read_checks(*(out / f"checks-r{r}.json" for r in range(nproc)), output=res.stdout)
    assert_checks(checks)
    return checks


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_save_issued_while_the_previous_step_uploads_is_acknowledged(tmp_path: Path) -> None:
    """The upload's waits (every rank for the outcome, the coordinator for the ranks' uploads)
    hold a store connection of their own: the next save's reports never queue behind them.
    Before, save 2 timed out after commit_timeout_s ("ranks [1] did not report")."""
    _run(tmp_path, "overlap", commit_delay_s=5.0, commit_timeout_s=3)


WRITERS = "tiers_writers_worker.py"


def _run_jobs(tmp_path: Path, mode: str, **cfg: Any) -> None:
    """Two jobs, a rank each (``tiers_writers_worker.py``), on one root."""
    out = tmp_path / mode
    config = {"root": str(tmp_path / "root"), "locals": [str(tmp_path / f"node{r}") for r in range(2)], **cfg}
    res = run_workers(2, WRITERS, mode, str(out), json.dumps(config), timeout_s=180)
    assert res.returncode == 0, res.stdout[-6000:]
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(2)), output=res.stdout))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_second_writer_of_a_step_is_refused_at_its_save(tmp_path: Path) -> None:
    """Two jobs on one root, each its own local tier, persist_every=1, the first upload slow:
    the second save of step 1 raises StepClaimedError at wait(), naming both writers, and
    commits nothing. Before, both wait()s returned; the second's upload failed later, and
    once its node was replaced it restored the other job's step 1 as its own."""
    _run_jobs(tmp_path, "two_writers", commit_delay_s=6.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_restarted_job_takes_over_and_its_zombie_cannot_upload(tmp_path: Path) -> None:
    """The restart (a new node) restores the persisted step and takes over the zombie's claim
    of the step above it; the zombie's upload of that step is then refused by name, and the
    root holds only the restarted job's steps. Before, the zombie's step 2 was persisted."""
    _run_jobs(tmp_path, "zombie")
