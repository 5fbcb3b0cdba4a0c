"""Accelerate: the last save_state() of a script that ends without end_training() is committed
at exit (it was lost 4 times out of 4), at several state sizes, several trials each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from tests.exit_check import run_python

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(16, 2), (1 << 18, 2)])  # 4 KiB and 64 MiB of weights (x3 with AdamW)
def test_save_state_without_end_training_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for trial in range(trials):
        root = str(tmp_path / f"r{trial}")
        rc, results, err = run_python(SCRIPT, root, str(width))
        assert rc == 0 and results == [{"saved": True}], err[-3000:]
        mgr = CheckpointManager(root)
        assert mgr.latest_step() is not None, f"trial {trial}: the last save_state() was lost at exit"
        model = torch.nn.Linear(width, 64)
        mgr.restore({"model": model}, only=["model/*"])
        ref = load_file(root + ".ref.safetensors")
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
        mgr.close()
