"""Two ranks whose clocks differ get the same ``should_save`` answers (tests/core/manager/test_schedule.py).

    schedule_worker.py ROOT OUT_DIR

Rank 1's schedule reads a clock that runs 7x fast from another origin, and rank 1 sleeps
longer per step than rank 0 (no other collective between the steps), so neither its clock
nor its pace is rank 0's. Each rank calls ``should_save`` at every step and saves (a
collective, synchronous) where it says so: first ``save_every_s=0.5``, then
``save_every_s="advised"`` on the same root. Each writes what it saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager


def skewed() -> float:
    return 1e6 + 7.0 * time.monotonic()


def run(mgr: CheckpointManager, rank: int, steps: range) -> dict[str, Any]:
    schedule = mgr._schedule
    if rank == 1:
        schedule.clock = skewed
    agree, checks = schedule._agree, [0]

    def counted(value: int) -> int:
        checks[0] += 1
        return agree(value)

    schedule._agree = counted
    said = []
    t0 = time.monotonic()
    for step in steps:
        time.sleep(0.01 if rank == 0 else 0.02 + 0.01 * (step % 3))
        if mgr.should_save(step):
            said.append(step)
            mgr.save(step, {"w": torch.full((16,), float(step)), "rank": rank}, async_save=False)
    return {
        "said": said,
        "steps": [s for s in mgr.steps() if s in steps],
        "checks": checks[0],
        "calls": len(steps),
        "elapsed": time.monotonic() - t0,
    }


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen: dict[str, Any] = {"rank": rank}
    with CheckpointManager(root, save_every_s=0.5) as mgr:
        seen["seconds"] = run(mgr, rank, range(0, 100))
    with CheckpointManager(root, save_every_s="advised", mtbf_s=30.0) as mgr:
        seen["advised"] = run(mgr, rank, range(100, 180))
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
