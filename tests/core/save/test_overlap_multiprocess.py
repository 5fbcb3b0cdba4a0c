"""Overlapped staging on 2 real gloo ranks under DDP, FSDP2, TP and FSDP1 (one torchrun
launch): see dist/overlap_worker.py for each check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CASES = (
    "parameters and optimizer state are deferred",
    "the step waited",
    "local parameter storage persists across steps",
    "step after save: checkpoint holds pre-save values",
    "step changed the live state (control)",
    "direct change after wait_staged: pre-save values",
    "racing change refused",
    "racing change: not committed",
    "accumulation ran while staging was pending",
    "accumulation then step: pre-save values",
)


def test_overlap_under_ddp_fsdp2_tp_fsdp1(tmp_path: Path) -> None:
    res = run_workers(2, "overlap_worker.py", str(tmp_path), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    expected = {f"{layout}: {case}" for layout in ("plain", "fsdp2", "tp", "fsdp1") for case in CASES}
    files = [tmp_path / "results" / f"overlap-r{rank}.json" for rank in range(2)]
    assert_checks(read_checks(*files, output=res.stdout), expected)
