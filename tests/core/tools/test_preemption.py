"""SIGTERM to a real 2-rank training job (torchrun, gloo) under PreemptionGuard."""

from __future__ import annotations

import os
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
from shardkeeper.core.tools.preemption import EXIT_CODE, read_record

from .._launch import DIST_DIR, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _run(root: Path, mode: str) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(DIST_DIR / "preempt_worker.py"),
        str(root),
        mode,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while not (root / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        time.sleep(0.3)
        for rank in range(2):  # the scheduler's SIGTERM reaches every worker
            os.kill(int((root / f"pid{rank}").read_text()), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate(timeout=30)
    return proc.returncode, out


def _restores_bit_exact(root: Path, step: int) -> None:
    want = deterministic_state(step, 64 << 10)
    got = _blank_like(want)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got) == step
    assert got["step"] == step
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


def test_sigterm_with_a_save_in_flight_abandons_it_cleanly(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, out = _run(tmp_path, "inflight")
    assert time.monotonic() - t0 < 60, "the grace period did not bound the exit"
    assert code != 0, out[-3000:]  # torchrun reports the workers' exit (143) as a failure
    assert out.count("preempted; last committed step 3, save of step 6 abandoned") == 2, out[-3000:]
    record = read_record(LocalStorage(tmp_path))
    assert record is not None, out[-3000:]
    assert record["last_committed_step"] == 3 and record["abandoned_step"] == 6, record
    assert CheckpointManager(tmp_path).steps() == [3]
    _restores_bit_exact(tmp_path, 3)


def test_sigterm_with_time_for_a_final_save(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "final")
    assert code != 0 and str(EXIT_CODE) in out, out[-3000:]
    record = read_record(LocalStorage(tmp_path))
    assert record is not None, out[-3000:]
    last = record["last_committed_step"]
    assert record["abandoned_step"] is None and last > 2, record
    assert CheckpointManager(tmp_path).steps()[-1] == last
    _restores_bit_exact(tmp_path, last)


def test_sigterm_on_a_step_the_loop_also_saves_exits_143_with_the_record(tmp_path: Path) -> None:
    """The loop saves every step, so SIGTERM lands on a step in flight: ``final_save`` of it
    waits for that save instead of saving it again (which the root refuses), and the job exits
    143 with the record, so that the scheduler requeues it."""
    code, out = _run(tmp_path, "collide")
    assert code != 0 and out.count(f"exitcode  : {EXIT_CODE}") == 2, out[-3000:]  # both ranks: 143
    assert "CommitConflictError" not in out and out.count("preempted; last committed step") == 2, out[-3000:]
    record = read_record(LocalStorage(tmp_path))
    assert record is not None, out[-3000:]
    last = record["last_committed_step"]
    assert record["abandoned_step"] is None and last > 2, record
    assert record["final_save"] == {"step": last, "committed": True, "saved": False, "error": None}, record
    _restores_bit_exact(tmp_path, last)


@pytest.mark.parametrize("mode", ["committed", "refused"])
def test_the_final_save_exits_143_with_the_record_whatever_the_save_did(tmp_path: Path, mode: str) -> None:
    """One process: ``final_save`` of step 5, which this manager committed (nothing saved),
    and of step 3, below the newest (the save raises ``StepOrderError``): exit 143 and
    ``preempted.json`` either way."""
    res = run_workers(1, "preempt_worker.py", str(tmp_path), mode, timeout_s=60)
    assert res.returncode == EXIT_CODE, res.stdout[-3000:]
    record = read_record(LocalStorage(tmp_path))
    assert record is not None and record["last_committed_step"] == 5, (record, res.stdout[-3000:])
    final = record["final_save"]
    if mode == "committed":
        assert final == {"step": 5, "committed": True, "saved": False, "error": None}, final
    else:
        assert final["step"] == 3 and not final["committed"] and "StepOrderError" in final["error"], final
        assert "the final save of step 3 failed" in res.stdout, res.stdout[-3000:]
    assert CheckpointManager(tmp_path).steps() == [4, 5]
