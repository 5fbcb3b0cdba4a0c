"""2 ranks: a row-sharded DTensor whose restore leaves out one piece on rank 1
(tests/core/restore/test_logical_check.py).

    logical_check_worker.py ROOT RESULTS

Steps 1 and 2 are saved; the restore of step 2 misses rank 1's piece of ``w`` (the planner's
test hook drops it, so its target keeps zeros), which only the exchange of partials can see
(no rank holds ``w`` whole). Both ranks must fall back to step 1 with a warning naming ``w``,
restore it bit for bit, and then restore step 2 cleanly. Each rank writes ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardkeeper.core import CheckpointManager
from shardkeeper.core.restore import plan as restore_plan


def _full(step: int) -> torch.Tensor:
    return torch.randn(10, 4, generator=torch.Generator().manual_seed(step))


def main(root: Path, results: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    mgr = CheckpointManager(root, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": distribute_tensor(_full(step), mesh, [Shard(0)])})
    left = [1 if rank == 1 else 0]

    def drop(plan: restore_plan.RestorePlan) -> None:
        if left[0]:
            left[0] -= 1
            plan.ops[:] = [o for o in plan.ops if o.key != "w"]

    restore_plan.FAULT = drop
    target = {"w": distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = mgr.restore(target)
    said = " ".join(str(w.message) for w in caught if "damaged" in str(w.message))
    equal = torch.equal(target["w"].full_tensor(), _full(1))
    again = mgr.restore(target)  # the hook is spent: step 2 passes its check
    ok = again == 2 and torch.equal(target["w"].full_tensor(), _full(2))
    stats = mgr.last_restore_stats
    ok = ok and stats is not None and stats.logical is not None and stats.logical.checked == 1
    out = {"restored": restored, "warning": said, "equal": equal, "checked_ok": ok, "sum": float(_full(1).sum())}
    (results / f"r{rank}.json").write_text(json.dumps(out))
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
