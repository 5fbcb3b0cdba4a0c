"""The erasure-coded node tier across two torchrun agents (``--nnodes=2``, 2 ranks each, the
persistent root on a loopback S3 server), as ``test_tiers.py`` runs replicas: node 1 is
killed (SIGKILL) with a save in flight and its directory deleted; the newest step committed
locally is rebuilt from node 0's parity and restores bit for bit with no byte read from S3."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.core.tiers.test_tiers import _config, _resume_phase, _save_phase


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_node_killed_mid_save_is_rebuilt_from_parity(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    """erasure=(1, 1): each node's files are one group, its parity on the other node. Steps
    2 and 3 point at step 1's files for unchanged tensors (incremental): rebuilt too."""
    cfg = _config(tmp_path, s3_root, steps=3, persist_every=100, erasure=[1, 1], expect_persisted=[1], kill_node=1)
    cfg["incremental"] = True
    _save_phase(tmp_path, [0, 1], cfg)
    assert not any((tmp_path / "node0").glob("step-000000000004/manifest.json"))  # the save in flight
    assert sorted(p.name for p in (tmp_path / "node0" / ".parity" / "step-000000000003").iterdir()) == [
        "g1-p0",
        "g1-p0.json",
    ]
    shutil.rmtree(tmp_path / "node1")  # the node is replaced by an empty one
    got = _resume_phase(tmp_path, [0, 1], cfg)
    assert [g["step"] for g in got] == [3] * 4, got
    assert [g["tier"] for g in got] == ["local"] * 4, got
    assert [g["persistent_reads"] for g in got] == [0] * 4, got
    assert any((tmp_path / "node1" / "step-000000000003" / "data").glob("r00002-*"))  # node 1's own files again
