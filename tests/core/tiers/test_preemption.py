"""SIGTERM to a 2-rank job whose ranks are two simulated nodes of a local tier (torchrun,
gloo), under PreemptionGuard: the final save reaches the persistent root within the grace
period, and the record says what each tier holds; then every local directory is deleted and
the final step restores from the persistent root bit for bit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.campaign import _blank_like, deterministic_state
from shardkeeper.core.testing.procs import kill_tree
from shardkeeper.core.tools.preemption import EXIT_CODE, RECORD_NAME, read_record
from tests.core._launch import DIST_DIR
from tests.launch import WORKER_MAIN

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _run(tmp_path: Path, mode: str, writer: str = "thread") -> tuple[int, str]:
    run = tmp_path / "run"
    run.mkdir()
    args = [str(run), str(tmp_path / "root"), str(tmp_path / "node0"), str(tmp_path / "node1"), mode, writer]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(WORKER_MAIN), str(DIST_DIR / "tiers_preempt_worker.py"), *args]  # (the shared tests.* helpers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while not (run / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        for rank in range(2):  # the scheduler's SIGTERM reaches every worker
            os.kill(int((run / f"pid{rank}").read_text()), signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate(timeout=30)
    return proc.returncode, out


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_final_save_is_uploaded_and_restores_after_every_node_is_replaced(tmp_path: Path, writer: str) -> None:
    """Before, exit() waited for the local commit only, then exited: the root held step 1 and
    no record, and new nodes restored step 1. With ``writer="process"`` the trainer's tiers
    upload nothing: the final upload is the persist process's (before, the record said
    ``{"step": None, "done": False}`` and the root held step 1 only)."""
    code, out = _run(tmp_path, "final", writer)
    assert code != 0 and str(EXIT_CODE) in out, out[-3000:]
    root = tmp_path / "root"
    assert not (tmp_path / "node0" / RECORD_NAME).exists()  # the record is the root's, not a node's
    record = read_record(LocalStorage(root))
    assert record is not None, out[-3000:]
    assert record["last_persisted_step"] == 4 and record["last_local_step"] == 4, record
    assert record["final_upload"] == {"step": 4, "done": True} and record["last_committed_step"] == 4, record
    assert _steps(root) == [1, 4]
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    want = deterministic_state(4, 64 << 10)
    got = _blank_like(want)
    with CheckpointManager(root, local=tmp_path / "new-node") as mgr:
        assert mgr.restore(got) == 4 and mgr.last_restore_tier == "persistent"
    assert got["step"] == 4
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


def test_a_final_upload_that_outlasts_the_grace_period_is_recorded_and_logged(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, out = _run(tmp_path, "slow")
    assert code != 0 and time.monotonic() - t0 < 60, out[-3000:]
    record = read_record(LocalStorage(tmp_path / "root"))
    assert record is not None, out[-3000:]
    assert record["final_upload"] == {"step": 4, "done": False} and record["last_persisted_step"] == 1, record
    assert record["last_local_step"] == 4 and record["last_committed_step"] == 4, record
    assert "step 4 was not uploaded to" in out and "within the grace period" in out, out[-3000:]
    assert "one on new nodes restores step 1" in out, out[-3000:]


def test_a_persist_process_dead_before_the_final_upload_is_recorded_as_not_uploaded(tmp_path: Path) -> None:
    """``writer="process"``: step 4 committed locally, then every persist process killed before
    ``exit()``: nothing can upload it, and the record and the log say so (never ``done``)."""
    code, out = _run(tmp_path, "dead", "process")
    assert code != 0 and str(EXIT_CODE) in out, out[-3000:]
    record = read_record(LocalStorage(tmp_path / "root"))
    assert record is not None, out[-3000:]
    final = record["final_upload"]
    assert final["step"] == 4 and final["done"] is False and "its persist process ended" in final["error"], record
    assert record["last_persisted_step"] == 1 and record["last_local_step"] == 4, record
    assert _steps(tmp_path / "root") == [1]
    assert "the final upload failed" in out and "step 4 was not uploaded to" in out, out[-3000:]
    assert "one on new nodes restores step 1" in out, out[-3000:]
