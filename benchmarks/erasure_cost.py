"""What ``erasure=(k, m)`` costs beside ``replicas=1``: 4 gloo ranks of one machine, each its own
local directory (four simulated nodes), ``--mib`` MiB of per-rank state each. Per setting:
the node-local bytes per node over the state the node wrote (the most of any node), the
median time to a locally committed (node-loss-safe) step after a warm-up save, and the time
to restore the newest step after node 1 was replaced by an empty directory (made whole from
a replica, or rebuilt from parity); beside them, a raw in-memory encode of one group's bytes
with the same code (``tiers/erasure.py``: XOR for m = 1, zfec for m >= 2).

    torchrun --nproc-per-node 4 benchmarks/erasure_cost.py [--mib 64] [--rounds 3] [--dir /dev/shm]

Rank 0 prints the figures as a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from shardkeeper.core.tiers.erasure import PIECE_BYTES, Code

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("replicas=1", {"replicas": 1}),
    ("erasure=(2, 1)", {"erasure": (2, 1)}),
    ("erasure=(3, 1)", {"erasure": (3, 1)}),
    ("erasure=(2, 2)", {"erasure": (2, 2)}),
]


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_encode(k: int, m: int, mib: int) -> float:
    """Seconds to code k nodes' ``mib`` MiB each in pieces, in memory (the best of 3)."""
    code = Code(k, m)
    data = [np.random.default_rng(i).integers(0, 256, mib << 20, dtype=np.uint8) for i in range(k)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for off in range(0, mib << 20, PIECE_BYTES):
            code.encode([d[off : off + PIECE_BYTES] for d in data])
        best = min(best, time.perf_counter() - t0)
    return best


def run(name: str, extra: dict[str, Any], base: Path, mib: int, rounds: int) -> dict[str, Any]:
    rank = dist.get_rank()
    work = base / name.translate(str.maketrans("=(), ", "-----"))
    root, local = work / "root", work / f"node{rank}"
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(rank)
    state = {"own": PerRank(torch.randn((mib << 20) // 4, generator=g))}
    mgr = CheckpointManager(root, local=local, local_keep=1, commit_timeout_s=600, **extra)
    mgr.save(1, state).wait()
    took = []
    for step in range(2, rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step, state).wait()
        took.append(time.perf_counter() - t0)
    mgr.close()
    last = rounds + 1
    own = sum(p.stat().st_size for p in (local / f"step-{last:012d}" / "data").glob(f"r{rank:05d}-*"))
    held = tree_bytes(local / f"step-{last:012d}") + tree_bytes(local / ".parity" / f"step-{last:012d}")
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)
    dist.barrier()
    target = {"own": PerRank(torch.zeros((mib << 20) // 4))}
    t0 = time.perf_counter()
    mgr = CheckpointManager(root, local=local, local_keep=1, commit_timeout_s=600, **extra)
    got = mgr.restore(target)
    restore_s = time.perf_counter() - t0
    ok = got == last and mgr.persistent_reads == 0 and torch.equal(target["own"].value, state["own"].value)
    mgr.close()
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"own": own, "held": held, "commit": statistics.median(took), "restore": restore_s})
    return {
        "memory": max(o["held"] / o["own"] for o in out),
        "commit": max(o["commit"] for o in out),
        "restore": max(o["restore"] for o in out),
        "ok": ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the nodes' directories go (default: a temporary one)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    made = [tempfile.mkdtemp(prefix="erasure-cost-", dir=args.dir) if rank == 0 else ""]
    dist.broadcast_object_list(made)
    base = Path(made[0])
    rows = []
    try:
        for name, extra in SETTINGS:
            got = run(name, extra, base, args.mib, args.rounds)
            code = extra.get("erasure")
            got["encode"] = raw_encode(code[0], code[1], args.mib) if code and rank == 0 else None
            rows.append((name, got))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank == 0:
        print(f"4 nodes x 1 rank, {args.mib} MiB per rank, the slowest rank; median of {args.rounds} saves")
        print(
            "| setting | node bytes / state (max) | locally committed (s) | restore, node 1 replaced (s) | raw encode of a group (s) | bit-exact, no persistent read |"
        )
        print("|---|---|---|---|---|---|")
        for name, r in rows:
            enc = f"{r['encode']:.3f}" if r["encode"] is not None else "-"
            print(f"| {name} | {r['memory']:.2f} | {r['commit']:.2f} | {r['restore']:.2f} | {enc} | {r['ok']} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
