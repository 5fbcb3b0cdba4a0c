"""``disable(accelerator)`` gives the Accelerator back exactly the methods ``enable`` replaced,
after committing the pending save; enabling again replaces the plugin."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager

REPLACED = ("save_state", "load_state", "prepare_data_loader", "end_training", "backward")


def test_disable_restores_the_accelerator(tmp_path: Path) -> None:
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    _, dl = acc.prepare(nn.Linear(3, 2), DataLoader(TensorDataset(torch.arange(6.0).unsqueeze(1)), batch_size=2))
    before = {name: vars(acc).get(name) for name in REPLACED}
    dl_before = dict(vars(dl))
    first = ska.enable(acc, root=str(tmp_path / "a"))
    second = ska.enable(acc, root=str(tmp_path / "b"))  # again: the new plugin replaces the first
    assert ska.plugin_of(acc) is second and first.patches.patched(acc, "save_state") is False
    acc.save_state()  # async: committed by disable()
    ska.disable(acc)
    assert {name: vars(acc).get(name) for name in REPLACED} == before
    assert acc.save_state.__func__ is Accelerator.save_state  # type: ignore[attr-defined]
    assert not hasattr(acc, "_shardkeeper")
    assert vars(dl).keys() == dl_before.keys()  # the DataLoader's per-batch hooks are gone too
    assert [b[0].tolist() for b in dl] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]]]
    with CheckpointManager(str(tmp_path / "b")) as mgr:
        assert mgr.steps() == [0]
    assert not (tmp_path / "a").exists()  # the first plugin never saved
    ska.disable(acc)  # idempotent
    acc.end_training()
