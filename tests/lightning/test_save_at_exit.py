"""Lightning: a trainer.save_checkpoint() after fit() in a script that ends without waiting is
committed at exit, at two state sizes. (Outside fit() the adapter saves
synchronously, and in fit() the strategy's teardown waits, so this guards the adapter's side
of the exit: it passed before the core learned to wait at exit, unlike the other adapters'.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.exit_check import restores_as_saved, saved_at_exit

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(8, 1), (1 << 18, 1)])  # 2 KiB and 64 MiB of weights (x3 with AdamW)
def test_save_checkpoint_after_fit_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for root in saved_at_exit(SCRIPT, tmp_path, width, trials):
        net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        # the LightningModule's FQNs are model.<i>...
        restores_as_saved(root, {"model": torch.nn.ModuleDict({"model": net})}, net)
