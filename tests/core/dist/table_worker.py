"""Two ranks save a table-form manifest (the chunk table threshold lowered to 1) through the
real store coordinator, then restore it into DTensors and into plain full tensors.

    table_worker.py ROOT      # under torchrun; each rank writes its checks to ROOT/result-r<R>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import shardkeeper.core.commit.merge as assemble
from shardkeeper.core import CheckpointManager, PerRank
from tests.checks import Checks


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(6 + i, 5, generator=g) for i in range(5)}


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks(root / f"result-r{rank}.json", rank=rank)
    checks.guard("table-form save and restores", lambda: run(root, rank, mesh, checks))
    checks.write()
    dist.destroy_process_group()


def run(root: Path, rank: int, mesh: DeviceMesh, checks: Checks) -> None:
    assemble.TABLE_MIN_CHUNKS = 1
    full = full_tensors()
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state = {"model": sharded, "plain": {"b": torch.arange(9.0)}, "note": PerRank({"rank": rank})}
    with CheckpointManager(root, digest_block_bytes=64) as mgr:
        mgr.save(1, state).wait()
        doc = json.loads((root / "step-000000000001" / "manifest.json").read_text())
        checks.check("the manifest is in table form", "chunk_table" in doc and doc["format_version"] == 1,
                     f"format_version {doc['format_version']}, keys {sorted(doc)}")
        # the same layout
        target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()},
                  "plain": {"b": torch.zeros(9)}, "note": PerRank({"rank": -1})}
        mgr.restore(target)
        got = {"model": {k: v.full_tensor() for k, v in target["model"].items()}, "plain": target["plain"]}
        checks.same("sharded and plain restore", got, {"model": full, "plain": {"b": torch.arange(9.0)}})
        checks.check("per-rank value", target["note"].value == {"rank": rank}, target["note"].value)
        # every rank reads every tensor whole: chunks written by both ranks
        whole = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
        mgr.restore(whole, only=["model"])
        checks.same("whole restore of chunks both ranks wrote", whole, {"model": full})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
