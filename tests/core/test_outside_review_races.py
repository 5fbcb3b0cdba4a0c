"""What a save protects, tested with real concurrent processes: a saver paused inside its
commit (right before the manifest's put, or before the commit's first record) while another
process deletes the base step of its incremental save, or runs gc with no minimum age.

Every outcome must be one of two: the save commits and restores bit for bit, or it fails
with an error that says what happened and nothing is committed. Never a committed step over
missing bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify import verify_step

SCRIPT = Path(__file__).parent / "dist" / "commit_race.py"
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _race(tmp_path: Path, point: str, kind: str, deleter: list[str]) -> tuple[dict, dict, Path]:
    root, ctl = tmp_path / "root", tmp_path / "ctl"
    ctl.mkdir()
    subprocess.run([sys.executable, str(SCRIPT), "setup", str(root)], check=True, env=_env(), timeout=120)
    saver = subprocess.Popen([sys.executable, str(SCRIPT), "save", str(root), str(ctl), point, kind], env=_env())
    other = subprocess.Popen([sys.executable, str(SCRIPT), deleter[0], str(root), str(ctl), *deleter[1:]], env=_env())
    try:
        assert saver.wait(timeout=120) == 0 and other.wait(timeout=120) == 0
    finally:
        for p in (saver, other):
            if p.poll() is None:
                p.kill()
    return json.loads((ctl / "saved.json").read_text()), json.loads((ctl / "deleter.json").read_text()), root


def _restores_step_3(root: Path) -> None:
    assert verify_step(open_storage(str(root)), 3).ok
    got = {"w": torch.zeros(64, 256), "step": 0}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got, step=3) == 3
    g = torch.Generator().manual_seed(1)
    assert torch.equal(got["w"], torch.randn(64, 256, generator=g)) and got["step"] == 3


def test_deleting_the_base_right_before_the_put_keeps_what_the_commit_references(tmp_path: Path) -> None:
    saved, deleter, root = _race(tmp_path, "put", "incremental", ["delete", "1"])
    assert deleter["deleted"] is True
    assert saved["committed"], saved
    assert not (root / step_dir(1) / "manifest.json").exists()  # step 1 is gone as a step ...
    _restores_step_3(root)  # ... but the files step 3 references were kept


def test_deleting_the_base_before_the_commit_fails_that_save_cleanly(tmp_path: Path) -> None:
    saved, deleter, root = _race(tmp_path, "intent", "incremental", ["delete", "1"])
    assert deleter["deleted"] is True
    assert not saved["committed"]
    assert "step 1 was deleted while this save ran" in saved["error"] and "nothing was committed" in saved["error"]
    assert not (root / step_dir(3) / "manifest.json").exists()
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [5]


def test_gc_right_before_the_put_leaves_the_commit_alone(tmp_path: Path) -> None:
    saved, report, root = _race(tmp_path, "put", "full", ["gc"])
    assert saved["committed"], saved
    _restores_step_3(root)
    assert step_dir(3) in report["kept_in_flight"], report


def test_gc_before_the_commit_makes_that_save_fail_cleanly(tmp_path: Path) -> None:
    saved, report, root = _race(tmp_path, "intent", "full", ["gc"])
    assert step_dir(3) + "/" in report["removed_dirs"], report
    assert not saved["committed"]
    assert "step 3" in saved["error"] and ("missing" in saved["error"] or "gc" in saved["error"]), saved
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1, 5]


@pytest.mark.parametrize("kind", ["incremental", "full"])
def test_nothing_left_behind(tmp_path: Path, kind: str) -> None:
    """After a commit, its intent is gone; after a gc, its claim is."""
    _, _, root = _race(tmp_path, "put", kind, ["gc"])
    assert not [n for n in os.listdir(root) if n.startswith("pending.")]
