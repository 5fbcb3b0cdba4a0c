"""2 ranks: per-rank JSON values with NaN, infinities and integers beyond 64 bits travel to the
coordinator in a report and come back exactly on every rank.

    json_worker.py ROOT OUT      # writes OUT/r<rank>.json: {"ok": true} or what differed
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank


def values(rank: int) -> dict:
    return {"seed": 2**90 + rank, "loss": float("nan") if rank else float("inf"), "n": -(2**65) - rank}


def same(a: dict, b: dict) -> bool:
    for k, v in a.items():
        w = b.get(k)
        if isinstance(v, float) and math.isnan(v):
            if not (isinstance(w, float) and math.isnan(w)):
                return False
        elif type(v) is not type(w) or v != w:
            return False
    return True


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(4), "mine": PerRank(values(rank))}, async_save=False)
        target = {"w": torch.zeros(4), "mine": PerRank({"seed": 0, "loss": 0.0, "n": 0})}
        mgr.restore(target)
        got = target["mine"].value
    result = {"ok": True} if same(values(rank), got) else {"ok": False, "got": repr(got)}
    (out / f"r{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
