"""The node-local tier with ``writer="process"`` (``tiers/process_writer.py``): the tier
tests' key scenarios across three simulated nodes with persist processes, and a trainer
killed right after ``save()`` returned whose step the restarted trainer restores from the
local tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replicas_and_erasure_across_nodes_with_persist_processes(tmp_path: Path) -> None:
    """The thread writer's runs of these scenarios: ``test_tiers.py``, ``test_erasure_nodes.py``
    (``tier_writer_worker.py thread`` runs this one's with the thread writer)."""
    res = run_workers(3, "tier_writer_worker.py", str(tmp_path), "process", timeout_s=240)
    assert res.returncode == 0, res.stdout[-8000:]
    assert_checks(read_checks(*(tmp_path / f"checks-r{r}.json" for r in range(3)), output=res.stdout))


_KILLED = """
import os, signal, sys, torch
from pathlib import Path
from shardkeeper.core import CheckpointManager
root, local = sys.argv[1], Path(sys.argv[2])
mgr = CheckpointManager(root, local=local, writer="process")
mgr.save(2, {"w": torch.arange(1 << 23, dtype=torch.float32)})  # 32 MiB: hashed and written after save() returns
print(mgr._saver.pid, flush=True)
Path(sys.argv[3]).write_text(str((local / "step-000000000002" / "manifest.json").exists()))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_trainer_killed_after_save_returned_restores_that_step_from_the_local_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer SIGKILLs itself right after ``save(2)`` returned, while step 2's manifest is
    not yet in its node's directory: its persist process commits it there, and the restarted
    trainer waits for that (the save's lock) and restores step 2 from the local tier."""
    import os
    import subprocess
    import sys
    import time

    import torch

    from shardkeeper.core import CheckpointManager

    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    root, local, seen = tmp_path / "root", tmp_path / "local", tmp_path / "seen"
    out = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root), str(local), str(seen)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert out.returncode == -9, out.stderr[-3000:]
    assert seen.read_text() == "False"  # not committed when the trainer died: the persist process committed it
    pid = int(out.stdout.split()[-1])
    target = {"w": torch.zeros(1 << 23)}
    with CheckpointManager(root, local=local) as mgr:  # waits for the persist process's lock of step 2
        assert mgr.restore(target) == 2
        assert mgr.last_restore_tier == "local"
    assert torch.equal(target["w"], torch.arange(1 << 23, dtype=torch.float32))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the persist process {pid} outlived its trainer's last save")
    assert not list((tmp_path / "locks").glob("*.lock"))
