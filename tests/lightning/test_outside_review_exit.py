"""Lightning: a trainer.save_checkpoint() after fit() (asynchronous) in a script that ends
without waiting is committed at exit, at two state sizes, two trials each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from tests.exit_check import run_python

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(8, 2), (1 << 18, 2)])  # 2 KiB and 64 MiB of weights (x3 with AdamW)
def test_save_checkpoint_after_fit_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for trial in range(trials):
        root = str(tmp_path / f"r{trial}")
        rc, results, err = run_python(SCRIPT, root, str(width))
        assert rc == 0 and results == [{"saved": True}], err[-3000:]
        mgr = CheckpointManager(root)
        assert mgr.latest_step() is not None, f"trial {trial}: the last save was lost at exit"
        net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        ref = load_file(root + ".ref.safetensors")
        target = {"model": torch.nn.ModuleDict({"model": net})}  # the LightningModule's FQNs: model.<i>...
        mgr.restore(target, only=["model/*"])
        assert all(torch.equal(v, ref[k]) for k, v in net.state_dict().items())
        mgr.close()
