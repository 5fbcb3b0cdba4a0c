"""The coordinator (rank 0) dies during a save, in a job where its process hosts the c10d store
(MASTER_ADDR/MASTER_PORT, no launcher agent): the other ranks' saves fail with a
``CheckpointSaveError`` naming the step, the coordinator and whether the step may have
committed, torch's ``DistNetworkError`` chained, instead of torch's raw error; a restore that
meets the dead rank in a collective raises a named ``CheckpointError``, and the preemption
guard's check stops as preempted."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardkeeper.core.testing.procs import kill_tree
from tests.checks import read_checks
from tests.launch import WORKER_MAIN

WORKER = Path(__file__).parents[1] / "dist" / "coordinator_loss_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["reported", "unreported", "after_commit"])
def test_the_coordinators_death_is_a_named_save_error(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [sys.executable, str(WORKER_MAIN), str(WORKER), mode, str(tmp_path / "root"), str(out)]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert procs[0].returncode == 17, outputs[0][-3000:]  # the coordinator died as planned
    checks = read_checks(out / "checks-r1.json", output=outputs[1])
    failed = [c for c in checks if not c["ok"]]
    assert not failed, failed
