"""An Accelerate run saved with ``save_state`` under ``shardkeeper.accelerate.enable`` (one
process, in this one) records, for every parameter and AdamW state tensor, ``logical_digest``
of the model's and optimizer's tensors in this process; with one tensor one ulp off the
compare fails."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager
from tests.logical_matrix import assert_matrix


def test_save_state_records_the_digests_of_its_tensors(tmp_path: Path) -> None:
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ska.enable(acc, root=str(tmp_path / "root"))
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        acc.backward(model(torch.randn(4, 6, generator=g)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    acc.save_state()
    ska.disable(acc)  # commits the save
    acc.end_training()
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        (step,) = mgr.steps()
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        for name, v in opt.state[p].items():
            tensors[f"optim/state/{fqn}/{name}"] = v
    assert len(tensors) == 4 + 4 * 3, sorted(tensors)
    assert_matrix([("Accelerate, 1 process", tmp_path / "root", step)], tensors)
