"""A training loop with a local tier under PreemptionGuard, on 2 gloo ranks that are two
simulated nodes (each its own local directory); the test sends SIGTERM from outside.

argv: RUN ROOT NODE0 NODE1 MODE (final | slow | dead) WRITER (thread | process). Steps 1-3
are saved (``persist_every=100``: only step 1 is uploaded), rank 0 writes RUN/ready, and the
loop waits for the guard; then step 4 is the final save and ``guard.exit()`` ends the process.
final: a 60 s grace period. slow: the persistent root's manifest put of step 4 takes 30 s and
the grace period is 4 s, so the final upload cannot finish. dead (``writer="process"``): once
step 4 is committed, each rank's persist process is killed (SIGKILL) before ``exit()``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardkeeper.core import CheckpointManager
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.campaign import deterministic_state
from shardkeeper.core.tools.preemption import PreemptionGuard
from tests.core.dist.slow_storage import Slow


def main() -> None:
    run, root, node0, node1, mode, writer = sys.argv[1:7]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    storage: Any = Slow(LocalStorage(root), 30, manifests="step-000000000004/manifest.json") if mode == "slow" else root
    mgr = CheckpointManager(
        storage,
        local=(node0, node1)[rank],
        replicas=1,
        persist_every=100,
        writer="process" if writer == "process" else "thread",
    )
    guard = PreemptionGuard(mgr, grace_s=4.0 if mode == "slow" else 60.0).install()
    Path(run, f"pid{rank}").write_text(str(os.getpid()))
    for step in (1, 2, 3):
        mgr.save(step, deterministic_state(step, 64 << 10)).wait()
    mgr.wait_persisted()
    if rank == 0:
        Path(run, "ready").write_text("3")
    deadline = time.monotonic() + 60
    while not guard.check():  # a training step each time round
        time.sleep(0.05)
        if time.monotonic() > deadline:
            raise SystemExit("never preempted")
    handle = mgr.save(4, deterministic_state(4, 64 << 10))
    if mode == "dead":  # the persist process dies after the local commit, before the final upload
        handle.wait()
        runner: Any = mgr._saver  # (a PersistRunner)
        os.kill(runner.pid, signal.SIGKILL)
        while runner.pid is not None:
            time.sleep(0.01)
    guard.exit()


if __name__ == "__main__":
    main()
