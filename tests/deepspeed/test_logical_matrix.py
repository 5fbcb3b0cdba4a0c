"""One model saved under ZeRO-1, -2 and -3 (2 ranks, one launch: ``dist/logical_worker.py``)
records, as built, the logical digests of the same model built in this process: its
parameters, and Adam's zero moments and step counters, which every stage holds before the
first step. After one training step ZeRO-1 and ZeRO-2, which compute the same values, record
the same digests for every tensor. With one tensor one ulp off the compare fails.

(ZeRO-3's first step is not bitwise ZeRO-1/2's: its gradients are reduced another way, so its
step-1 values, and digests, differ in the last bits; it is compared at step 0.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deepspeed.logical_net import Net
from tests.launch import run_script
from tests.logical_matrix import assert_matrix, inspect_digests

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "logical_worker.py"


def _one_process() -> dict[str, torch.Tensor]:
    """The model as built (seed 0) and its Adam state before a step, keyed as a checkpoint keys them."""
    torch.manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for fqn, p in Net().named_parameters():
        out[f"model/{fqn}"] = p.detach().clone()
        out[f"optim/state/{fqn}/exp_avg"] = torch.zeros_like(p)
        out[f"optim/state/{fqn}/exp_avg_sq"] = torch.zeros_like(p)
        out[f"optim/state/{fqn}/step"] = torch.tensor(0.0)
    return out


def test_zero_stages_record_the_one_process_digests(tmp_path: Path) -> None:
    res = run_script(2, WORKER, str(tmp_path), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    tensors = _one_process()
    stages = [(f"ZeRO-{s} at 2 ranks, step 0", tmp_path / f"z{s}", 0) for s in (1, 2, 3)]
    for name, root, step in stages:
        assert set(inspect_digests(root, step)) == set(tensors), name
    assert_matrix(stages, tensors)
    z1, z2 = inspect_digests(tmp_path / "z1", 1), inspect_digests(tmp_path / "z2", 1)
    assert set(z1) == set(tensors) and None not in z1.values(), z1
    assert z1 == z2, sorted(k for k in z1 if z1[k] != z2.get(k))
    assert z1 != inspect_digests(tmp_path / "z1", 0)  # the step changed every value it should
