"""DeepSpeed: the last engine.save_checkpoint() of a script that ends without hook.wait() is
committed at exit (the hook's own atexit wait ran after the thread pools stopped), at two
state sizes, two trials each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from tests.exit_check import run_python

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(8, 2), (1 << 18, 2)])  # 2 KiB and 64 MiB of weights (x3 with Adam)
def test_save_checkpoint_without_wait_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for trial in range(trials):
        root = str(tmp_path / f"r{trial}")
        rc, results, err = run_python(SCRIPT, root, str(width))
        assert rc == 0 and results == [{"saved": True}], err[-3000:]
        mgr = CheckpointManager(root)
        assert mgr.steps() == [1], f"trial {trial}: the last save_checkpoint() was lost at exit"
        model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        mgr.restore({"model": model}, only=["model/*"])
        ref = load_file(root + ".ref.safetensors")
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
        mgr.close()
