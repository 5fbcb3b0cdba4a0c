"""Described layouts on real process groups (tests/core/save/test_described.py).

    described_worker.py ROOT OUT_DIR

At 4 ranks: a state of DTensors in several layouts (row and column shards, uneven and empty
shards, 2-D, HSDP's Replicate + Shard, a scalar) plus a plain tensor, saved with
``describe_layouts`` True, False and by default; restored into the same layout, into others
and into plain tensors, bit for bit; the index files each restore read; ``verify``; and a
damaged index file; FSDP1-style ShardedTensors, described where their shards follow the
rule. Each rank writes what it saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from seen import finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step


def full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(20, 12, generator=g),  # uneven over 4: 5 5 5 5; over 3: 7 7 6
        "few": torch.randn(3, 8, generator=g),  # fewer rows than ranks: an empty shard
        "cols": torch.randn(6, 37, generator=g),
        "grid": torch.randn(10, 9, generator=g),
        "hsdp": torch.randn(11, 4, generator=g),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(24, dtype=torch.int64).reshape(4, 6),
        "strided": torch.randn(24, 3, generator=g),  # FSDP2 over TP on one dimension (even: distribute_tensor)
        "sub": torch.randn(9, 4, generator=g),  # FSDP2 over TP: a parameter TP does not split, on the DP submesh
        "plain": torch.randn(7, generator=g),
    }


def layout_a(w: int) -> dict:
    m1, m2 = init_device_mesh("cpu", (w,)), init_device_mesh("cpu", (2, w // 2))
    named = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("dp", "tp"))
    f = full()
    return {
        "sub": distribute_tensor(f["sub"], named["dp"], [Shard(0)]),
        "rows": distribute_tensor(f["rows"], m1, [Shard(0)]),
        "few": distribute_tensor(f["few"], m1, [Shard(0)]),
        "cols": distribute_tensor(f["cols"], m1, [Shard(1)]),
        "grid": distribute_tensor(f["grid"], m2, [Shard(0), Shard(1)]),
        "hsdp": distribute_tensor(f["hsdp"], m2, [Replicate(), Shard(0)]),
        "scalar": distribute_tensor(f["scalar"], m1, [Replicate()]),
        "ids": distribute_tensor(f["ids"], m2, [Shard(1), Shard(0)]),
        "strided": distribute_tensor(f["strided"], m2, [_StridedShard(0, split_factor=w // 2), Shard(0)]),
        "plain": f["plain"],
    }


def layout_b(w: int) -> dict:
    """Another placement of every tensor, zero-filled (a restore target)."""
    m2 = init_device_mesh("cpu", (w // 2, 2))
    out = {}
    for k, v in full().items():
        z = torch.zeros_like(v)
        out[k] = z if k == "plain" or v.dim() == 0 else distribute_tensor(z, m2, [Shard(v.dim() - 1), Replicate()])
    return out


def gathered(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def same(a: dict, b: dict) -> list[str]:
    return [k for k in b if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    seen: dict[str, object] = {"rank": rank}
    ref = full()
    for name, describe in (("on", True), ("off", False), ("auto", None)):
        path = Path(root) / name
        with CheckpointManager(path, describe_layouts=describe) as mgr:
            mgr.save(1, {"m": layout_a(w)}).wait()
            step_dir = path / "step-000000000001"
            man = json.loads((step_dir / "manifest.json").read_text())
            seen[f"{name} version"] = [man["format_version"], man.get("requires", [])]
            seen[f"{name} described"] = man.get("described", {}).get("keys", [])
            seen[f"{name} enumerated"] = man["leaf_table"]["keys"] if "leaf_table" in man else sorted(man["leaves"])
            for tname, target in (
                ("same", layout_a(w)),
                ("other", layout_b(w)),
                ("plain", {k: torch.zeros_like(v) for k, v in ref.items()}),
            ):
                for v in target.values():
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
                state = {"m": target}
                mgr.restore(state, step=1)
                seen[f"{name} {tname} wrong"] = same(gathered(state["m"]), ref)
                seen[f"{name} {tname} index files"] = mgr.last_restore_stats.index_files
            if rank == 0:
                rep = verify_step(LocalStorage(str(path)), 1)
                seen[f"{name} verify"] = [p.message for p in rep.problems]
        dist.barrier()
    # Incremental: unchanged boxes of described leaves are references into step 1's files.
    path = Path(root) / "inc"
    with CheckpointManager(path, describe_layouts=True, incremental=True, data_prefixes=4) as mgr:
        state = {"m": layout_a(w)}
        mgr.save(1, state, async_save=False)
        state["m"]["rows"].to_local().add_(1.0)
        mgr.save(2, state, async_save=False)
        man = json.loads((path / "step-000000000002" / "manifest.json").read_text())
        seen["inc references"] = [p for p in man["described"]["chunk_files"]["path"] if p.startswith("../")]
        target = {"m": {k: torch.zeros_like(v) for k, v in ref.items()}}
        mgr.restore(target, step=2)
        want = {**ref, "rows": ref["rows"] + 1.0}
        seen["inc wrong"] = same(target["m"], want)
    # ShardedTensors (FSDP1's sharded state dicts): dimension 0 chunked over the world in rank
    # order is described; placements in another order are not the rule, and stay enumerated.
    import torch.distributed._shard.sharded_tensor as sharded
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    path = Path(root) / "sharded"
    g = torch.Generator().manual_seed(5)
    want = {"chunked": torch.randn(10, 3, generator=g), "reversed": torch.randn(9, 2, generator=g)}
    orders = {"chunked": range(w), "reversed": reversed(range(w))}
    state = {}
    for k, v in want.items():
        st = sharded.empty(ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in orders[k]]), *v.shape)
        for shard in st.local_shards():
            md = shard.metadata
            rows = slice(md.shard_offsets[0], md.shard_offsets[0] + md.shard_sizes[0])
            shard.tensor.copy_(v[rows])
        state[k] = st
    with CheckpointManager(path, describe_layouts=True) as mgr:
        mgr.save(1, state, async_save=False)
        man = json.loads((path / "step-000000000001" / "manifest.json").read_text())
        seen["sharded described"] = man.get("described", {}).get("keys", [])
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        mgr.restore(target, step=1)
        seen["sharded wrong"] = same(target, want)
    # A damaged index file: restores that need it refuse, naming it and its rank; verify says so.
    path = Path(root) / "on"
    if rank == 0:
        (idx,) = sorted((path / "step-000000000001" / "data").glob("r00002-*.index.json"))
        doc = json.loads(idx.read_text())
        doc["table"]["offset"][0] += 4  # the size stays, the digest no longer matches
        text = json.dumps(doc, separators=(",", ":"))
        idx.write_text(text + " " * (idx.stat().st_size - len(text)))
    dist.barrier()
    with CheckpointManager(path) as mgr:
        state = {"m": {k: torch.zeros_like(v) for k, v in ref.items()}}
        try:
            mgr.restore(state, step=1)
        except CorruptCheckpointError as e:
            seen["damaged"] = str(e)
        else:
            seen["damaged"] = None
    if rank == 0:
        rep = verify_step(LocalStorage(str(path)), 1)
        seen["damaged verify"] = [p.message for p in rep.problems]
    finish(out, rank, seen)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
