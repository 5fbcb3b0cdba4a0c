"""Two ranks save a table-form manifest (the chunk table threshold lowered to 1) through the
real store coordinator, then restore it into DTensors and into plain full tensors.

    table_worker.py ROOT      # under torchrun; each rank writes ROOT/result-r<R>.json
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import shardkeeper.core.assemble as assemble
from shardkeeper.core import CheckpointManager, PerRank


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(6 + i, 5, generator=g) for i in range(5)}


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    failures: list[str] = []
    try:
        assemble.TABLE_MIN_CHUNKS = 1
        full = full_tensors()
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        state = {"model": sharded, "plain": {"b": torch.arange(9.0)}, "note": PerRank({"rank": rank})}
        with CheckpointManager(root, digest_block_bytes=64) as mgr:
            mgr.save(1, state).wait()
            doc = json.loads((root / "step-000000000001" / "manifest.json").read_text())
            if "chunk_table" not in doc or doc["format_version"] < 3:
                failures.append("the manifest is not in table form")
            # the same layout
            target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()},
                      "plain": {"b": torch.zeros(9)}, "note": PerRank({"rank": -1})}
            mgr.restore(target)
            for k, v in full.items():
                if not torch.equal(target["model"][k].full_tensor(), v):
                    failures.append(f"sharded restore of {k} differs")
            if not torch.equal(target["plain"]["b"], torch.arange(9.0)):
                failures.append("plain restore differs")
            if target["note"].value != {"rank": rank}:
                failures.append(f"per-rank value {target['note'].value}")
            # every rank reads every tensor whole: chunks written by both ranks
            whole = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
            mgr.restore(whole, only=["model"])
            for k, v in full.items():
                if not torch.equal(whole["model"][k], v):
                    failures.append(f"whole restore of {k} differs")
    except Exception:
        failures.append(traceback.format_exc())
    (root / f"result-r{rank}.json").write_text(json.dumps({"rank": rank, "failures": failures}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
