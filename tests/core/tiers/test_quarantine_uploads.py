"""After a restore quarantines a step on the persistent root, the steps uploaded next are the
same in both writer modes: ``persist_every`` counts from the persistent root's newest step
left, whether the uploads run in the trainer or in its persist process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.format.layout import step_dir
from tests.checks import assert_same_state

pytestmark = pytest.mark.timeout(180)


def _state(step: int, run: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1000 * run)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(32, generator=g)}


def _blank() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(64, 64), "b": torch.zeros(32)}


def _flip(root: Path, step: int) -> None:
    """Flip a byte of key ``a``'s data in ``step`` under ``root``."""
    c = json.loads((root / manifest_path(step)).read_bytes())["leaves"]["a"]["chunks"][0]
    path = root / step_dir(step) / c["file"]
    raw = bytearray(path.read_bytes())
    raw[c["offset"] + c["length"] // 2] ^= 0x20
    path.write_bytes(bytes(raw))


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").exists())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_uploads_after_a_quarantine_are_the_same_in_both_writer_modes(
    tmp_path: Path, writer: Literal["thread", "process"], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 1 to 5 with ``persist_every=2`` upload 1, 3 and 5. Step 5 is then damaged on the
    persistent root and gone from the node's directory; the same manager's restore falls back,
    quarantines step 5 there (3 is the newest step left) and restores step 4 from the local
    tier. Saving 5 to 7 again then uploads 5 (two past 3) and 7, as a fresh count would."""
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    with CheckpointManager(persistent, local=local, persist_every=2, writer=writer) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step)).wait()
            mgr.wait_persisted()
        assert mgr.persisted_steps == [1, 3, 5]
        _flip(persistent, 5)
        shutil.rmtree(local / step_dir(5))
        got = _blank()
        with pytest.warns(UserWarning, match="step 5 under .* was quarantined"):
            assert mgr.restore(got) == 4
        assert_same_state(got, _state(4), what="step 4 from the local tier")
        uploaded = []  # the persistent root's steps after each save
        for step in range(5, 8):
            mgr.save(step, _state(step, run=1)).wait()
            mgr.wait_persisted()
            uploaded.append(_steps(persistent))
        assert uploaded == [[1, 3, 5], [1, 3, 5], [1, 3, 5, 7]]
        assert mgr.persisted_steps == [1, 3, 5, 7]  # (step 5 once, though uploaded twice)
    assert _steps(persistent) == [1, 3, 5, 7]
    shutil.rmtree(local)
    got = _blank()
    with CheckpointManager(persistent, local=tmp_path / "fresh") as mgr:
        assert mgr.restore(got) == 7 and mgr.last_restore_tier == "persistent"
    assert_same_state(got, _state(7, run=1), what="step 7 from the persistent root")
