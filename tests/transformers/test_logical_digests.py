"""A ShardkeeperTrainer run (one process, in this one) records, for every tensor of the model's
state dict and of AdamW's state, ``logical_digest`` of the trained model's and optimizer's
tensors in this process; with one tensor one ulp off the compare fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.logical_matrix import assert_matrix, inspect_digests
from tests.transformers.common import make_trainer

pytestmark = [pytest.mark.timeout(300)]


def test_a_trainer_save_records_the_digests_of_its_tensors(tmp_path: Path) -> None:
    root = tmp_path / "root"
    trainer = make_trainer(root, max_steps=2, save_steps=2)
    trainer.train()
    model, opt = trainer.model, trainer.optimizer
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        for name, v in opt.state[p].items():
            tensors[f"optim/state/{fqn}/{name}"] = v
    recorded = inspect_digests(root, 2)
    assert {k for k in recorded if not k.startswith("rng/")} == set(tensors), sorted(set(recorded) ^ set(tensors))
    assert_matrix([("Trainer, 1 process", root, 2)], tensors)
