"""Ranks that disagree on a save's terms (4 gloo ranks).

    terms_worker.py ROOT OUT

- ranks 0-2 save step 2 and rank 3 step 3, with replicated state only, then with a per-rank
  tensor too (steps 4 and 5): every rank's save fails naming each rank's step, nothing is
  committed;
- rank 3's manager hashes with sha256, the others with xxh3_128: every rank's save fails
  naming the option and each rank's value;
- then every rank saves step 7 alike: it commits (the ranks are still in step);
- under group commit (groups of 2), rank 2 saves step 9 and the others step 8: its group's
  leader fails the save naming it; step 10 commits afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, CheckpointSaveError, PerRank
from shardkeeper.core.commit.committed import manifest_steps
from shardkeeper.core.storage.local import LocalStorage
from tests.checks import Checks

checks = Checks()
check = checks.check


def expect_failure(name: str, mgr: CheckpointManager, step: int, state: dict, *needles: str) -> None:
    try:
        mgr.save(step, state).wait()
    except CheckpointSaveError as e:
        text = str(e)
        check(name, all(n in text for n in needles), text)
    else:
        check(name, False, f"save({step}) was acknowledged")


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    replicated = {"w": torch.arange(64, dtype=torch.float32)}
    mgr = CheckpointManager(root, commit_timeout_s=60)
    steps_named = ("step 2 on ranks 0-2", "step 3 on rank 3")
    expect_failure("different steps, replicated state", mgr, 3 if rank == 3 else 2, replicated, *steps_named)
    own = {**replicated, "own": PerRank(torch.full((16,), float(rank)))}
    expect_failure(
        "different steps, per-rank state", mgr, 5 if rank == 3 else 4, own, "step 4 on ranks 0-2", "step 5 on rank 3"
    )
    dist.barrier()
    check("nothing committed", manifest_steps(LocalStorage(root)) == [], manifest_steps(LocalStorage(root)))
    other = CheckpointManager(root, commit_timeout_s=60, digest="sha256" if rank == 3 else "xxh3_128")
    expect_failure(
        "different digest", other, 6, own, "different digest", "'sha256' on rank 3", "'xxh3_128' on ranks 0-2"
    )
    other.close()
    mgr.save(7, own).wait()
    check("the same step commits afterwards", 7 in manifest_steps(LocalStorage(root)))
    mgr.close()
    # group commit: rank 0 alone, ranks 1-2 led by rank 1, rank 3 alone; rank 2's leader sees it
    grouped = CheckpointManager(root, commit_timeout_s=60, commit_group_ranks=2)
    expect_failure("different steps in a group", grouped, 9 if rank == 2 else 8, own, "step 9 on rank 2")
    grouped.save(10, own).wait()
    check("group commit in step afterwards", 10 in manifest_steps(LocalStorage(root)))
    grouped.close()
    checks.write(out / f"checks-r{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
