"""The training-loop benchmark keeps running: `benchmarks/loop.py --quick` end to end (FSDP2 on
2 gloo ranks, every method, DCP on its own group), and `benchmarks/direct_io.py --quick`;
checked for structure, never for speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_quick_loop_benchmark_runs_every_method(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "loop.py"),
        "--quick",
        "--results-dir",
        str(tmp_path / "results"),
        "--workdir",
        str(tmp_path),
        "--timeout-s",
        "240",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    [path] = (tmp_path / "results").glob("loop-*-quick.json")
    data = json.loads(path.read_text())
    methods = data["methods"]
    assert set(methods) == {
        "none",
        "sk_blocking",
        "sk_overlap",
        "sk_buffered",
        "sk_process",
        "sk_process_overlap",
        "dcp_reuse",
        "dcp_async_staging",
        "dcp_process",
    }
    for m, row in methods.items():
        assert row["loop_s"] > 0 and math.isfinite(row["overhead_s"]), (m, row)
    assert data["info"]["raw_copy_s"] > 0 and data["info"]["state_bytes_per_rank"] > 0
    assert methods["sk_overlap"]["stall_s"] > 0  # save() ran and returned in every round
    assert methods["sk_process"]["stall_s"] > 0  # (and through a persist process)
    # the wait for the save after the last step: part of the loop, and none without a save
    assert all(0 <= row["tail_s"] <= row["loop_s"] for row in methods.values()), methods
    assert methods["none"]["tail_s"] < 0.01, methods["none"]


def test_quick_direct_io_benchmark_runs(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "direct_io.py"),
        "--quick",
        "--results-dir",
        str(tmp_path / "results"),
        "--workdir",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    [path] = (tmp_path / "results").glob("direct-io-*-quick.json")
    med = json.loads(path.read_text())["median"]
    assert set(med) == {
        f"{w}, {m}"
        for w in ("raw write + fsync", "shardkeeper async save", "shardkeeper sync save")
        for m in ("buffered", "O_DIRECT")
    }
    assert all(v["wall_s"] > 0 for v in med.values()), med
