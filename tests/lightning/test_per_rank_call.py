"""Every error about ``per_rank`` under Lightning names ``ShardkeeperCheckpointIO(root,
per_rank=...)``, where its user sets it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import PerRank
from shardkeeper.lightning import ShardkeeperCheckpointIO

CALL = r"\(set it in ShardkeeperCheckpointIO\(root, per_rank=\.\.\.\)\)"


def test_per_rank_errors_name_the_plugin_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"per_rank='nope'.*" + CALL):
        ShardkeeperCheckpointIO(tmp_path / "bad", per_rank="nope").binding.manager()
    io = ShardkeeperCheckpointIO(tmp_path / "root", async_save=False)
    mgr = io.binding.manager()
    try:
        mgr.save(1, {"own": PerRank(torch.ones(2))})
        with pytest.raises(ValueError, match=r"per_rank='nope'.*" + CALL):
            mgr.restore({"own": PerRank(torch.zeros(2))}, per_rank="nope")
    finally:
        mgr.close()
