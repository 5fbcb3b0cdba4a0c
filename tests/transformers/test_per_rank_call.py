"""Every error about ``per_rank`` under the Trainer names ``enable(trainer, per_rank=...)`` and
``ShardkeeperTrainer(shardkeeper_options=...)``, where its user sets it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import PerRank
from shardkeeper.transformers import plugin_of
from tests.transformers.common import make_trainer

CALL = r"\(set it in enable\(trainer, per_rank=\.\.\.\) or ShardkeeperTrainer\(shardkeeper_options=\{'per_rank': \.\.\.\}\)\)"


def test_per_rank_errors_name_the_trainer_calls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"per_rank='nope'.*" + CALL):
        plugin_of(make_trainer(tmp_path / "bad", options={"per_rank": "nope"})).manager()
    plugin = plugin_of(make_trainer(tmp_path / "out", options={"async_save": False}))
    mgr = plugin.manager()
    mgr.save(1, {"own": PerRank(torch.ones(2))})
    with pytest.raises(ValueError, match=r"per_rank='nope'.*" + CALL):
        mgr.restore({"own": PerRank(torch.zeros(2))}, per_rank="nope")
    plugin.close()
