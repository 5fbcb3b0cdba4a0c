"""A trainer that leaves its persist process with nothing to save (tests/core/persist/test_persist_orphans.py).

    persist_orphan_worker.py ROOT MODE

Each rank makes a ``writer="process"`` manager on ROOT and writes its persist process's pid
to ``ROOT.pid.<rank>``. ``plain``: every rank exits before its first save, without
``close()``. ``kill``: rank 1 SIGKILLs itself before its first save (torchrun tears rank 0
down). ``fork``: one rank saves step 1, forks a child that outlives it (as a DataLoader
worker can), then SIGKILLs itself; the child writes its pid to ``ROOT.child`` and sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager


def main(root: str, mode: str) -> None:
    if mode != "fork":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mgr = CheckpointManager(root, writer="process", commit_timeout_s=600)
    Path(f"{root}.pid.{rank}").write_text(str(getattr(mgr._saver, "pid", None) or 0))
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill":
        time.sleep(60)  # (torchrun tears this rank down once rank 1 is gone)
    if mode == "fork":
        mgr.save(1, {"w": torch.arange(8.0)})
        if os.fork() == 0:
            Path(f"{root}.child").write_text(str(os.getpid()))
            time.sleep(60)
            os._exit(0)
        while not Path(f"{root}.child").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
