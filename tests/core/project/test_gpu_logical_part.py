"""benchmarks/gpu.py's fourth part, the logical digests' cost on the device: its dry run
measures every case on CPU and checks the sums against the numpy path, and its verdict
follows that check (the times are reported, never judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gpu_report
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run")
@pytest.mark.timeout(240)
def test_the_logical_part_dry_runs_every_case(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--parts", "logical"]
    cmd += ["--results-dir", str(tmp_path / "r"), "--workdir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    data = json.loads(next((tmp_path / "r").glob("gpu-*-dry-run.json")).read_text())
    cases = data["logical"]["result"]["cases"]
    assert set(cases) == {"whole", "column", "odd_rows", "small"}
    assert all(c["equal"] is True and c["device_s"] > 0 and c["raw_copy_s"] > 0 for c in cases.values()), cases
    assert {r["part"] for r in data["targets"]} == {"logical"}
    assert "| logical | whole: device s/GiB |" in next((tmp_path / "r").glob("gpu-*-dry-run.md")).read_text()


def test_the_logical_verdicts_follow_the_sums() -> None:
    case = {"device_s_per_gib": 0.01, "device_per_raw_copy": 0.3, "host_numpy_s_per_gib": 0.5}
    doc = {"logical": {"result": {"cases": {"whole": {**case, "equal": True}, "small": {**case, "equal": False}}}}}
    verdicts = {r["what"]: r["pass"] for r in gpu_report.targets(doc)}
    assert verdicts["whole: device sums equal the host definition's"] is True
    assert verdicts["small: device sums equal the host definition's"] is False
    assert verdicts["whole: device / raw D2H"] is None
    assert {r["what"]: r["pass"] for r in gpu_report.targets({"logical": {"rc": 1}})} == {"ran": False}
