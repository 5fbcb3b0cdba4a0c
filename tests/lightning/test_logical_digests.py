"""A Lightning fit saved through ``ShardkeeperCheckpointIO`` (one process, in this one) records,
for every parameter and AdamW state tensor, ``logical_digest`` of the module's and optimizer's
tensors in this process after the fit; with one tensor one ulp off the compare fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from shardkeeper.lightning import ShardkeeperCheckpointIO
from tests.lightning.common import Net, cpu_trainer, loader
from tests.logical_matrix import assert_matrix

pytestmark = [pytest.mark.timeout(240)]


def test_a_fit_records_the_digests_of_its_tensors(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=8)  # the fit's last step
    trainer = cpu_trainer(tmp_path, ShardkeeperCheckpointIO(root), callbacks=[mc])
    lm = Net()
    trainer.fit(lm, loader())
    assert trainer.global_step == 8
    tensors = {f"model/{k}": v for k, v in lm.state_dict().items()}
    opt = trainer.optimizers[0]
    for fqn, p in lm.named_parameters():
        for name, v in opt.state[p].items():
            assert isinstance(v, torch.Tensor), (fqn, name)
            tensors[f"optim/state/{fqn}/{name}"] = v
    assert len(tensors) == 4 + 4 * 3, sorted(tensors)
    assert_matrix([("Lightning, 1 process", root, 8)], tensors)
