"""A trainer killed right after ``save()`` returned, with a node-local tier and
``writer="process"``: 2 gloo ranks under torchrun, each its own local directory (two
simulated nodes), ``replicas=1``, ``persist_every=1``.

    tier_kill_worker.py OUT MODE

MODE ``kill``: step 3 is saved; each rank records whether the step's manifest is in its
node's directory once ``save()`` returned (``seen<rank>``) and its persist process's pid
(``pid<rank>``); rank 1's trainer then SIGKILLs itself and torchrun tears rank 0's down.
MODE ``resume``: a fresh launch (thread writer) restores the newest step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from tests.checks import Checks

checks = Checks()
check = checks.check


def state(step: int, rank: int) -> dict[str, Any]:
    return {"x": PerRank(torch.arange(1 << 22, dtype=torch.float32) * step + rank)}  # 16 MiB per rank


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw: dict[str, Any] = {"local": out / f"node{rank}", "replicas": 1, "persist_every": 1, "commit_timeout_s": 60}
    if mode == "kill":
        mgr = CheckpointManager(out / "root", writer="process", **kw)
        mgr.save(3, state(3, rank))
        (out / f"seen{rank}").write_text(str((out / f"node{rank}" / "step-000000000003" / "manifest.json").exists()))
        (out / f"pid{rank}").write_text(str(mgr._saver.pid))  # type: ignore[attr-defined]
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # torn down by torchrun once rank 1 died
        return
    with CheckpointManager(out / "root", **kw) as mgr:
        got: dict[str, Any] = {"x": PerRank(torch.zeros(1 << 22))}
        step = mgr.restore(got)
        check("the step saved right before the kill restored", step == 3, step)
        check("from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
        check("bit-exact", torch.equal(got["x"].value, state(3, rank)["x"].value))
    dirs = sorted(p.name for p in (out / "root").glob("step-*") if (p / "manifest.json").exists())
    check("the orphaned persist processes uploaded it", "step-000000000003" in dirs, dirs)
    checks.write(out / f"resume-r{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
