"""Every error about ``per_rank`` under Accelerate names ``enable(accelerator, per_rank=...)``,
where its user sets it (the refusal at another world size: test_world_size_change.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import shardkeeper.accelerate as ska
from shardkeeper.core import PerRank


def test_per_rank_errors_name_the_enable_call(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"'per_rank' from the arguments of enable\(\) is 'nope'"):
        ska.enable(acc, root=str(tmp_path), per_rank="nope")
    plugin = ska.enable(acc, root=str(tmp_path), async_save=False)
    try:
        mgr = plugin.manager(str(tmp_path))
        mgr.save(1, {"own": PerRank(torch.ones(2))})
        with pytest.raises(ValueError, match=r"per_rank='nope'.*\(set it in enable\(accelerator, per_rank=\.\.\.\)\)"):
            mgr.restore({"own": PerRank(torch.zeros(2))}, per_rank="nope")
    finally:
        ska.disable(acc)
