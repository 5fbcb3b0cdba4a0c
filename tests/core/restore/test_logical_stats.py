"""``last_restore_stats.logical`` after a restore that fell back: it describes the step that
was restored, and says so in a short repr (counts, not the manifest, keys or digests), so a
log line of the stats stays a line. One process: a real ``CheckpointManager``; the newest
step's recorded digest edited, so that its logical check fails and the restore falls back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.logical_member import tensor_keys
from shardkeeper.core.format.manifest import Manifest


def _state(step: int) -> dict[str, object]:
    return {"model": {f"w{i}": torch.full((8, 3), float(step + i)) for i in range(40)}, "n": step}


def test_the_stats_of_a_fallback_describe_the_restored_step_in_short(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    path = root / step_dir(2) / "manifest.json"
    doc = json.loads(path.read_bytes())
    at = tensor_keys(Manifest.loads(path.read_bytes()).leaves).index("model/w7")
    digests = doc["logical"]["digests"].split(",")
    digests[at] = format(int(digests[at], 16) ^ 1, "016x")
    doc["logical"]["digests"] = ",".join(digests)
    path.write_text(json.dumps(doc))

    target = _state(0)
    with CheckpointManager(root) as mgr:
        with pytest.warns(UserWarning, match="tensor 'model/w7'"):
            assert mgr.restore(target) == 1  # step 2's check failed: fell back
        assert mgr.steps() == [1]  # (step 2 quarantined: verify --logical proved its digest wrong)
        check = mgr.last_restore_stats.logical  # type: ignore[union-attr]
    assert torch.equal(target["model"]["w7"], torch.full((8, 3), 8.0))  # type: ignore[index]
    assert check.manifest.step == 1 and check.checked == 40 and not check.problems
    text = repr(check)
    assert text == "LogicalCheck(step=1, checked=40, problems=0, skipped=0, rank=0)", text
    assert len(repr(mgr.last_restore_stats)) < 600, repr(mgr.last_restore_stats)
