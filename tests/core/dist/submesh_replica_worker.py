"""4 ranks: a DTensor on a submesh whose copies disagree at save (tests/core/save/test_replicas.py).

    submesh_replica_worker.py ROOT RESULTS

A 2x2 mesh ``("dp", "tp")``; ``fsdp/w`` and ``fsdp/b`` are row-sharded on ``mesh["dp"]``
(FSDP2 over the data-parallel dimension alone): TP ranks 0 and 1 of a DP index hold the same
shard, a copy the DTensor's mesh does not name. Per run (chunks listed, and recorded by their
rule): step 1 saved with every copy equal, then restored bit for bit; step 2 with rank 3's
copy of ``fsdp/w`` one ulp off: refused on every rank naming the tensor, the step and the
ranks (step 1 stays the newest); with ``logical_check="warn"`` committed with the mark. Then
every rank's ``logical_partial`` of ``fsdp/w``: combined over the world, the full tensor's
``logical_digest`` (each TP copy counted once). Each rank writes ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardkeeper.core import CheckpointManager, logical_combine, logical_digest, logical_partial


def _full(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g), torch.randn(6, generator=g)


def _state(sub: Any, step: int, off: bool) -> dict[str, Any]:
    w, b = _full(step)
    out = {"fsdp/w": distribute_tensor(w, sub, [Shard(0)]), "fsdp/b": distribute_tensor(b, sub, [Shard(0)])}
    if off and dist.get_rank() == 3:
        local = out["fsdp/w"].to_local()
        local[1, 2] = torch.nextafter(local[1, 2], torch.tensor(float("inf")))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def main(root: Path, results: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sub = mesh["dp"]
    got: dict[str, Any] = {}
    runs: tuple[tuple[str, Literal["error", "warn"], bool | None], ...] = (
        ("listed", "error", None),
        ("described", "error", True),
        ("warn", "warn", None),
    )
    for name, mode, described in runs:
        with CheckpointManager(root / name, async_save=False, logical_check=mode, describe_layouts=described) as mgr:
            mgr.save(1, _state(sub, 1, False))
            clean = "replicas_disagree" not in (mgr.manifest(1).logical or {})
            target = {k: distribute_tensor(torch.zeros_like(v), sub, [Shard(0)]) for k, v in zip("wb", _full(1))}
            restored = mgr.restore({"fsdp/w": target["w"], "fsdp/b": target["b"]})
            exact = all(torch.equal(_bits(target[k].full_tensor()), _bits(v)) for k, v in zip("wb", _full(1)))
            try:
                mgr.save(2, _state(sub, 2, True))
                err = ""
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            member = mgr.manifest(mgr.latest_step()).logical or {}
            got[name] = {
                "clean": clean,
                "restored": restored,
                "exact": exact,
                "error": err,
                "latest": mgr.latest_step(),
                "mark": member.get("replicas_disagree", ""),
            }
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, logical_partial(_state(sub, 1, False)["fsdp/w"]))
    got["partials"] = {"combined": logical_combine(parts), "digest": logical_digest(_full(1)[0])}
    (results / f"r{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
