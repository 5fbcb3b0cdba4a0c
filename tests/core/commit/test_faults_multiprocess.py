"""Fault injection on 3 real gloo ranks (FSDP2): a write failing on one named rank, a failing
commit, a rank hanging past the commit timeout, a flipped byte on disk, a damaged newest
manifest, a storage failing on one rank during a restore, the async race and a partial
restore. See dist/faults_worker.py for each check; this test runs them in one launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXPECTED = {
    "write fails on rank 1",
    "write fails on rank 1: no manifest",
    "commit fails",
    "commit fails: no manifest",
    "rank 2 hangs",
    "rank 2 hangs: no manifest",
    "steps after failures",
    "async race: the checkpoint holds the pre-save values",
    "latest falls back to step 5",
    "fallback warns",
    "fallback restored step 5 bit for bit",
    "ref7 differs from ref5 (control)",
    "damaged newest manifest: falls back to step 5",
    "damaged newest manifest: warns naming step 8",
    "damaged newest manifest: step 5 bit for bit",
    "storage failure on rank 1 is raised everywhere",
    "partial restore changes exactly the selected keys",
    "partial restore restored them exactly",
    "partial restore reads at most 5% more than needed",
}


def test_faults_on_three_ranks(tmp_path: Path) -> None:
    res = run_workers(3, "faults_worker.py", str(tmp_path), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"faults-r{rank}.json" for rank in range(3)), output=res.stdout)
    assert_checks(checks, EXPECTED)
    errors = ("checksum error names key and file", "other ranks hear of the damage")
    damaged = [c for c in checks if c["name"] in errors]
    assert sorted(c["rank"] for c in damaged) == [0, 1, 2], "every rank must raise when restoring the damaged step"
