"""DeepSpeed: the last engine.save_checkpoint() of a script that ends without hook.wait() is
committed at exit (the hook's own atexit wait ran after the thread pools stopped), at two
state sizes, two trials each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.exit_check import restores_as_saved, saved_at_exit

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(8, 2), (1 << 18, 2)])  # 2 KiB and 64 MiB of weights (x3 with Adam)
def test_save_checkpoint_without_wait_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for root in saved_at_exit(SCRIPT, tmp_path, width, trials):
        model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        restores_as_saved(root, {"model": model}, model)
