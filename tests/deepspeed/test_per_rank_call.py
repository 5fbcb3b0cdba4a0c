"""Every error about ``per_rank`` under DeepSpeed names ``attach(engine, per_rank=...)``, where
its user sets it (dist/per_rank_call.py, one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "dist" / "per_rank_call.py"


def test_per_rank_errors_name_the_attach_call(tmp_path: Path) -> None:
    res = run_script(1, SCRIPT, str(tmp_path / "root"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for what in ("attach", "restore"):
        msg = out[what]
        assert msg is not None and msg.startswith("ValueError: ") and "'nope'" in msg, (what, msg)
        assert "attach(engine, per_rank=...)" in msg, (what, msg)
