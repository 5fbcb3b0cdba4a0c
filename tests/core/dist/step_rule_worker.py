"""Every rank of a group refuses a save below the newest committed step (tests/core/commit/test_step_rule.py).

    step_rule_worker.py ROOT OUT_DIR

Saves steps 5 and 10, then 7 (below the newest, never committed) and 5 (committed, below the
newest); then restores whose ranks ask for different steps, and one they agree on. Each rank
writes what it saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, StepOrderError


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager(root)
    for step in (5, 10):
        mgr.save(step, {"w": torch.full((64,), float(step))}, async_save=False)
    seen: dict[str, object] = {"rank": rank}
    for step in (7, 5):
        try:
            mgr.save(step, {"w": torch.zeros(64)}, async_save=False)
        except StepOrderError as e:
            seen[str(step)] = {"message": str(e), "step": e.step, "newest": e.newest}
        else:
            seen[str(step)] = None
    mgr.save(11, {"w": torch.full((64,), 11.0)}, async_save=False)  # the protocol is still in step
    seen["steps"] = mgr.steps()
    # Restores whose ranks ask for different steps are refused on every rank, none read.
    for name, asked in (("5 vs 10", [5, 10]), ("newest vs 10", [None, 10])):
        target = {"w": torch.zeros(64)}
        try:
            mgr.restore(target, step=asked[rank])
        except ValueError as e:
            seen[f"restore {name}"] = {"message": str(e), "untouched": bool((target["w"] == 0).all())}
        else:
            seen[f"restore {name}"] = None
    target = {"w": torch.zeros(64)}
    seen["restore 10 everywhere"] = mgr.restore(target, step=10) == 10 and bool((target["w"] == 10).all())
    mgr.close()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
