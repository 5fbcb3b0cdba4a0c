"""The coordinator's process dies during a save, in a job where it hosts the c10d store (ranks
started with MASTER_ADDR/MASTER_PORT, no launcher agent: rank 0's ``init_process_group``
starts the store's server). 2 ranks.

    coordinator_loss_worker.py MODE ROOT OUT

- ``reported``: rank 0's manifest put hangs and rank 0 exits 2 s into it; rank 1 has reported
  and waits for the outcome: its save fails with ``CheckpointSaveError`` naming the step, the
  coordinator and that the step may have been committed, with torch's error chained.
- ``unreported``: rank 1's write takes 5 s; rank 0 exits while rank 1 still writes: rank 1's
  save fails, once written, naming that the step was not committed.
- ``after_commit``: rank 0 dies after both committed step 1: rank 1's ``restore()`` fails with
  a named ``CheckpointError`` (a rank is gone), and ``PreemptionGuard.check()`` stops as
  preempted instead of raising gloo's error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, CheckpointSaveError, PerRank
from shardkeeper.core.storage.local import LocalStorage
from tests.checks import Checks
from tests.core.dist.slow_storage import Slow

checks = Checks()
check = checks.check


def after_commit(root: str, out: Path) -> None:
    """Both ranks commit step 1; rank 0 dies; rank 1's restore and its preemption guard's
    check meet the dead rank in a collective of the training group."""
    from shardkeeper.core import CheckpointError, PreemptionGuard

    rank = dist.get_rank()
    mgr = CheckpointManager(root, commit_timeout_s=60)
    mgr.save(1, {"w": torch.arange(16, dtype=torch.float32)}).wait()
    dist.barrier()
    if rank == 0:
        os._exit(17)
    time.sleep(1.0)
    try:
        mgr.restore({"w": torch.zeros(16)})
    except CheckpointError as e:
        check("restore fails with a named CheckpointError", "a rank died or its host is gone" in str(e), str(e))
    except BaseException as e:  # noqa: BLE001 - the defect: gloo's raw error
        check("restore fails with a named CheckpointError", False, f"{type(e).__name__}: {e}")
    else:
        check("restore fails", False, "restored")
    guard = PreemptionGuard(mgr, grace_s=30)
    try:
        check("the guard stops as preempted", guard.check() is True)
    except BaseException as e:  # noqa: BLE001
        check("the guard stops as preempted", False, f"{type(e).__name__}: {e}")
    checks.write(out / f"checks-r{rank}.json")
    os._exit(0)


def main() -> None:
    mode, root, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "after_commit":
        after_commit(root, out)
    what, who, delay_s = {"reported": ("manifest", 0, 60.0), "unreported": ("data", 1, 5.0)}[mode]
    delay_s = delay_s if rank == who else 0.0
    storage = Slow(LocalStorage(root), delay_s) if what == "manifest" else Slow(LocalStorage(root), delay_s, data="*/data/*")
    mgr = CheckpointManager(storage, commit_timeout_s=120)
    state = {"w": torch.arange(16, dtype=torch.float32), "own": PerRank(torch.full((4,), float(rank)))}
    if rank == 0:
        threading.Timer(2.0, os._exit, (17,)).start()  # the coordinator dies mid-save
    t0 = time.monotonic()
    try:
        mgr.save(1, state).wait()
    except CheckpointSaveError as e:
        text, cause = str(e), e.__cause__
        check("the save fails with CheckpointSaveError naming the step", "save of step 1 on rank 1" in text, text)
        check("it names the coordinator", "coordinator (rank 0)" in text, text)
        want = "may have committed" if mode == "reported" else "the step was not committed"
        check("it says whether the step may have committed", want in text, text)
        root_cause = cause.__cause__ if cause is not None else None
        check("torch's error is chained", type(root_cause).__name__ == "DistNetworkError", repr(root_cause))
    except BaseException as e:  # noqa: BLE001 - the defect: torch's raw error
        check("the save fails with CheckpointSaveError naming the step", False, f"{type(e).__name__}: {e}")
    else:
        check("the save fails", False, "acknowledged")
    check("at once, not after the outcome's timeout", time.monotonic() - t0 < 60, time.monotonic() - t0)
    checks.write(out / f"checks-r{rank}.json")
    os._exit(0)  # the process group's teardown would wait for the dead coordinator


if __name__ == "__main__":
    main()
