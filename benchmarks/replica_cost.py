"""What replica agreement (docs/reliability.md, "Replicas that disagree at save") costs the
caller of ``save()``: at 2 gloo ranks of one machine, a replicated state (plain tensors, as
DDP's) saved asynchronously with ``logical_check="error"`` (each rank sums the copies it does
not write before ``save()`` returns) and ``"off"``, alternating; the medians of the stall
(``save()`` to its return) and of the whole save, per mode.

    torchrun --nproc-per-node 2 benchmarks/replica_cost.py [--mib 256] [--rounds 5]

Rank 0 prints the figures.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    per = (args.mib << 20) // 8
    st = {f"w{i}": torch.randn(per // 4, generator=g).reshape(-1, 1024) for i in range(8)}
    work = [tempfile.mkdtemp(prefix="replica-cost-") if rank == 0 else ""]
    dist.broadcast_object_list(work)
    root = Path(work[0])
    mgrs = {m: CheckpointManager(root / m, keep_last=1, logical_check=m) for m in ("error", "off")}
    times: dict[str, list[tuple[float, float]]] = {"error": [], "off": []}
    step = 0
    for r in range(args.rounds + 1):  # the first round warms up
        for m in ("error", "off") if r % 2 == 0 else ("off", "error"):
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            handle = mgrs[m].save(step, st)
            stall = time.perf_counter() - t0
            handle.wait()
            if r:
                times[m].append((stall, time.perf_counter() - t0))
    for mgr in mgrs.values():
        mgr.close()
    if rank == 0:
        print(f"{args.mib} MiB replicated on 2 ranks, {args.rounds} rounds, medians:")
        for m, v in times.items():
            print(
                f"  logical_check={m!r}: stall {statistics.median(s for s, _ in v):.3f} s, "
                f"save {statistics.median(w for _, w in v):.3f} s"
            )
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
