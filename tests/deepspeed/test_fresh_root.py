"""A fresh DeepSpeed run on an attached root that holds steps is refused at the engine's
first backward, before any training step, naming the root, the newest step and the remedies;
a resumed run and a root holding only a torn step train on (dist/fresh_root.py, one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "dist" / "fresh_root.py"


def test_a_fresh_run_on_a_used_root_is_refused_before_training(tmp_path: Path) -> None:
    root = tmp_path / "root"
    res = run_script(1, SCRIPT, str(root), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    msg = out["refused"]
    assert msg is not None, "a fresh run on a used root trained"
    assert f"{root} already holds committed step 2 (rank 0); this run starts from step 0" in msg
    assert f"engine.load_checkpoint({str(root)!r})" in msg and "attach(engine, <another root>)" in msg
    assert "start over with this root emptied" in msg
    assert out["untouched"] and out["fresh_steps"] == 0
    assert out["steps"] == [2, 3] and out["torn_trains"] == 1
