"""``shardkeeper ls`` of an Accelerator's ``project_dir`` follows it to the root the plugin
saves under (``project_dir/checkpoints``), saying so, instead of listing nothing there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration
from torch import nn

import shardkeeper.accelerate as ska
from shardkeeper.core.cli import main

pytestmark = [pytest.mark.timeout(120)]


def test_ls_of_the_project_dir_follows_to_its_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "proj"
    AcceleratorState._reset_state()
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config)
    ska.enable(acc, async_save=False)
    lin = nn.Linear(3, 2)
    model, opt = acc.prepare(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    for _ in range(2):
        acc.backward(model(torch.ones(4, 3)).sum())
        opt.step()
        opt.zero_grad()
        acc.save_state()  # steps 0, 1 under project/checkpoints
    acc.end_training()
    capsys.readouterr()
    assert main(["ls", str(project)]) == 0
    out, err = capsys.readouterr()
    assert f"following {project} to root {project / 'checkpoints'}" in err
    assert "no checkpoints" not in out + err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["0", "1"]
