"""The benchmark keeps running: `benchmarks/run.py --quick` end to end (every case, real
torchrun launches), checked for structure and correctness, never for speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_quick_benchmark_runs_and_every_restore_matches_its_save(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--quick",
        "--no-readme",
        "--results-dir",
        str(tmp_path / "results"),
        "--workdir",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    [path] = (tmp_path / "results").glob("*-quick.json")
    data = json.loads(path.read_text())
    assert data["errors"] == []
    cases = {r["case"] for r in data["ratios"]}
    assert {"b", "e"} <= cases and any(c.startswith(("a-", "c-", "d-")) for c in cases), cases
    assert all(isinstance(r["value"], (int, float)) for r in data["ratios"] if r["case"] != "e")
    assert data["case_e"]["commit_s"] > 0 and data["case_e"]["plan_s"] > 0
    restores = [s for s in data["samples"] if "verified" in s]
    assert restores and all(s["verified"] for s in restores), "a benchmarked restore did not reproduce the saved state"


def test_only_a_full_run_writes_the_days_results_and_the_readme() -> None:
    """A run of some cases (``--cases b``) is labelled and never replaces the full results."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as bench_run
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    full = {"cases": ["a", "b", "c", "d", "e"], "sizes": [256.0, 1024.0], "n_tensors": 10_000}
    assert bench_run.partial_label(full) is None
    assert (
        bench_run.partial_label(vars(bench_run.parse_args([])) | {"cases": sorted(bench_run.parse_args([]).cases)})
        is None
    )
    assert bench_run.partial_label({**full, "cases": ["b"]}) == "cases-b"
    assert bench_run.partial_label({**full, "sizes": [64.0]}) == "cases-abcde-64MiB"
    assert bench_run.partial_label({**full, "cases": ["b"], "n_tensors": 1000}) == "cases-b-n1000"
