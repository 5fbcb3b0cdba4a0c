"""2 ranks: replicated tensors whose copies disagree at save (tests/core/save/test_replicas.py).

    replica_worker.py ROOT RESULTS

Plain tensors (DDP's replication) and a replicated DTensor: step 1 saved with every copy
equal; step 2 with rank 1's copy of ``model/w`` one ulp off (and, for the DTensor root, its
copy of ``norm``): the save must fail on both ranks naming the tensor, the step and the
ranks, and step 1 stays the newest; ``logical_check="warn"`` commits step 2 with the mark in
the manifest (chunks listed, and the DTensor recorded by its rule), and a fresh manager's
restore of it warns; ``"off"`` compares nothing. Each rank writes ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from shardkeeper.core import CheckpointManager


def _state(rank: int, off: bool, mesh: Any, dtensor: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    w, b, n = torch.randn(6, 5, generator=g), torch.randn(5, generator=g), torch.randn(7, generator=g)
    if off and rank == 1:
        w = w.clone()
        w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(float("inf")))
        n = n.clone()
        n[4] = torch.nextafter(n[4], torch.tensor(float("inf")))
    out: dict[str, Any] = {"model/w": w, "model/b": b}
    if dtensor:
        out["norm"] = distribute_tensor(torch.zeros(7), mesh, [Replicate()])
        out["norm"].to_local().copy_(n)  # (distribute_tensor would broadcast rank 0's)
    return out


def _ddp_batchnorm(root: Path, rank: int) -> dict[str, Any]:
    """A DDP model with BatchNorm after a forward on each rank's own batch: its running
    statistics differ by rank (DDP syncs buffers at the next forward), its parameters agree.
    The save must commit; then one parameter changed on rank 1 must be refused."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + rank)))
    out: dict[str, Any] = {}
    with CheckpointManager(root.with_name("ddp_bn_sd"), async_save=False) as mgr:
        mgr.save(1, {"model": model.state_dict()})  # (plain tensors: no module to name its buffers)
        out["state_dict_latest"] = mgr.latest_step()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": model})
        out["latest"] = mgr.latest_step()
        with torch.no_grad():
            if rank == 1:
                model.module[0].weight[0, 0] += 1.0
        try:
            mgr.save(2, {"model": model})
            out["error"] = ""
        except Exception as e:
            out["error"] = str(e)
    return out


def _restore_marked(root: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """A fresh manager's restore of the marked step 2: the written copy's values, the warnings
    it logged and the mark in its stats."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardkeeper").addHandler(handler)
    try:
        state = {"model/w": torch.zeros(6, 5), "model/b": torch.zeros(5)}
        with CheckpointManager(root, async_save=False, logical_check="warn") as mgr:
            step = mgr.restore(state)
            stats = mgr.last_restore_stats
    finally:
        logging.getLogger("shardkeeper").removeHandler(handler)
    written = _state(0, True, mesh, False)["model/w"]  # (rank 0's, the written copy)
    return {
        "step": step,
        "written": bool(torch.equal(state["model/w"], written)),
        "warnings": [w for w in said if "disagree" in w],
        "stats_mark": getattr(stats, "replicas_disagree", None),
    }


def main(root: Path, results: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    got: dict[str, Any] = {}
    runs = (
        ("error", "error", False, False),
        ("dtensor", "error", True, False),
        ("described", "error", True, True),  # (the DTensor recorded by its rule, its chunks in index files)
        ("warn", "warn", False, False),
        ("described_warn", "warn", True, True),
    )
    for name, mode, dtensor, described in runs:
        with CheckpointManager(root / name, async_save=False, logical_check=mode, describe_layouts=described) as mgr:
            mgr.save(1, _state(rank, False, mesh, dtensor))
            try:
                mgr.save(2, _state(rank, True, mesh, dtensor))
                err = ""
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            member = mgr.manifest(mgr.latest_step()).logical or {}
            got[name] = {"error": err, "latest": mgr.latest_step(), "mark": member.get("replicas_disagree", "")}
        if name == "warn":
            got[name]["restore"] = _restore_marked(root / name, rank, mesh)
    with CheckpointManager(root / "off", async_save=False, logical_check="off") as mgr:
        mgr.save(1, _state(rank, True, mesh, False))
        got["off"] = {"latest": mgr.latest_step()}
    got["ddp_bn"] = _ddp_batchnorm(root / "ddp_bn", rank)

    (results / f"r{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
