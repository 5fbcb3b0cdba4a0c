"""The two tiers under real concurrency: saves issued while an upload runs, on 2 ranks whose
local tiers are directories of their own (two simulated nodes).

    tiers_concurrency_worker.py MODE OUT CONFIG_JSON

The persistent root is a local directory behind a storage that holds every manifest put for
``CONFIG["commit_delay_s"]`` (a slow object store's commit), so that an upload is still
running when the next save is issued.

- ``overlap``: saves 1..4 back to back, ``persist_every=2``: each is acknowledged at once,
  whatever upload runs, and steps 1 and 3 end up persisted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointError, CheckpointManager
from shardkeeper.core.storage.local import LocalStorage
from tests.checks import Checks
from tests.core.dist.slow_storage import Slow

checks = Checks()
check = checks.check


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(64, 64), "step": step}


def manager(cfg: dict[str, Any], **extra: Any) -> CheckpointManager:
    rank = dist.get_rank()
    root = Slow(LocalStorage(cfg["root"]), cfg["commit_delay_s"])
    kwargs: dict[str, Any] = {
        "local": cfg["locals"][rank],
        "replicas": 1,
        "persist_every": 2,
        "commit_timeout_s": cfg["commit_timeout_s"],
    }
    return CheckpointManager(root, **{**kwargs, **extra})


def overlap(out: Path, cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    mgr = manager(cfg)
    took = {}
    for step in range(1, 5):
        t0 = time.monotonic()
        try:
            mgr.save(step, state(step)).wait()
        except CheckpointError as e:
            check(f"save {step} acknowledged", False, f"{type(e).__name__}: {e}")
        took[step] = time.monotonic() - t0
    # Save 2 ran while step 1's upload waited in its slow commit: it owed nothing to it.
    check("save 2 acknowledged while upload 1 ran", took[2] < cfg["commit_delay_s"], took)
    try:
        mgr.wait_persisted()
    except CheckpointError as e:
        check("uploads", False, str(e))
    check("steps 1 and 3 persisted", mgr.persisted_steps == [1, 3], mgr.persisted_steps)
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def main() -> None:
    mode, out, cfg = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    {"overlap": overlap}[mode](out, cfg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
