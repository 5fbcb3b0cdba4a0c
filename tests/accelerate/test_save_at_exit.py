"""Accelerate: the last save_state() of a script that ends without end_training() is committed
at exit (it was lost 4 times out of 4), at several state sizes, several trials each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.exit_check import restores_as_saved, saved_at_exit

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

SCRIPT = Path(__file__).parent / "dist" / "exit_script.py"


@pytest.mark.parametrize(("width", "trials"), [(16, 2), (1 << 18, 2)])  # 4 KiB and 64 MiB of weights (x3 with AdamW)
def test_save_state_without_end_training_is_committed_at_exit(tmp_path: Path, width: int, trials: int) -> None:
    for root in saved_at_exit(SCRIPT, tmp_path, width, trials):
        model = torch.nn.Linear(width, 64)
        restores_as_saved(root, {"model": model}, model)
