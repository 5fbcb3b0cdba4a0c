"""A fresh run on a root that holds steps is refused at its first ``backward()``, before any
training step, not at its first ``save_state()``; a resumed run and a root holding only a
crash's leftovers train on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration
from torch import nn

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager, StartRefusedError

pytestmark = [pytest.mark.timeout(120)]


def _run(project: Path) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project)))
    ska.enable(acc, async_save=False)
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    model, opt = acc.prepare(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    return acc, model, opt


def _step(acc: Accelerator, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    acc.backward(model(torch.ones(4, 3)).sum())
    opt.step()
    opt.zero_grad()


def test_a_fresh_run_on_a_used_root_is_refused_before_training(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    acc, model, opt = _run(project)
    for _ in range(3):
        _step(acc, model, opt)
        acc.save_state()  # steps 0, 1, 2
    acc.end_training()

    acc, model, opt = _run(project)  # the same command run again, without load_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StartRefusedError) as refused:
        _step(acc, model, opt)
    msg = str(refused.value)
    root = project / "checkpoints"
    assert f"{root} already holds committed step 2 (rank 0); this run starts from step 0" in msg
    assert "accelerator.load_state()" in msg and "enable(accelerator, root=...)" in msg
    assert "start over with this root emptied" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert acc.step == 0 and acc.project_configuration.iteration == 0
    acc.end_training()

    acc, model, opt = _run(project)  # resumed: trains and saves on
    assert acc.load_state() == 2
    _step(acc, model, opt)
    assert acc.save_state().endswith("step-000000000003")
    acc.end_training()
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [0, 1, 2, 3]

    torn = tmp_path / "torn"
    (torn / "checkpoints" / "step-000000000000" / "data").mkdir(parents=True)  # no manifest
    acc, model, opt = _run(torn)
    _step(acc, model, opt)
    acc.end_training()
