"""A training loop under PreemptionGuard on gloo ranks; the test sends SIGTERM from outside.

argv: ROOT MODE (inflight | final | collide | committed | refused). inflight: the commit is
slow (rank 0 sleeps 30 s before the manifest) and the grace period short, so the save in
flight at SIGTERM is abandoned. final: the loop checks the guard every step and takes a final
save at a safe point. collide: the loop saves every step, so the signal always lands on a step
it saves: ``guard.final_save`` of that step. committed, refused (one process, no torchrun: it
sends itself SIGTERM after committing step 5): ``final_save`` of step 5, which this manager
committed, and of step 3, which the root refuses (below its newest).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from shardkeeper.core import CheckpointManager
from shardkeeper.core.tools.preemption import PreemptionGuard
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.campaign import deterministic_state


class SlowCommit(LocalStorage):
    def put_if_absent(self, path: str, data: bytes) -> None:
        if path.endswith("manifest.json") and "step-000000000006" in path:
            time.sleep(30)
        super().put_if_absent(path, data)


def alone(root: str, mode: str) -> None:
    mgr = CheckpointManager(root)
    guard = PreemptionGuard(mgr, grace_s=30.0).install()
    for step in (4, 5):
        mgr.save(step, deterministic_state(step, 64 << 10))
    mgr.wait()  # step 5 committed; no save pending
    os.kill(os.getpid(), signal.SIGTERM)
    while not guard.check():
        time.sleep(0.01)
    final = 5 if mode == "committed" else 3
    guard.final_save(final, deterministic_state(final, 64 << 10))


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    if mode in ("committed", "refused"):
        return alone(root, mode)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    storage = SlowCommit(root) if mode == "inflight" else LocalStorage(root)
    mgr = CheckpointManager(storage)
    guard = PreemptionGuard(mgr, grace_s=2.0 if mode == "inflight" else 60.0).install()
    Path(root, f"pid{rank}").write_text(str(os.getpid()))
    for step in range(1, 10_000):
        time.sleep(0.05)  # a training step
        if mode == "inflight" and step in (3, 6):
            mgr.save(step, deterministic_state(step, 64 << 10))
            if step == 3:
                mgr.wait()
                if rank == 0:
                    Path(root, "ready").write_text("3")
        if mode == "collide":
            mgr.save(step, deterministic_state(step, 64 << 10))  # the schedule: every step
            if step == 2 and rank == 0:
                Path(root, "ready").write_text("2")
            if guard.check():
                guard.final_save(step, deterministic_state(step, 64 << 10))  # never returns
        if mode == "final":
            if step == 2:
                mgr.save(step, deterministic_state(step, 64 << 10)).wait()
                if rank == 0:
                    Path(root, "ready").write_text("2")
            if guard.check():
                mgr.save(step, deterministic_state(step, 64 << 10))
                guard.exit()
    raise SystemExit("never preempted")


if __name__ == "__main__":
    main()
