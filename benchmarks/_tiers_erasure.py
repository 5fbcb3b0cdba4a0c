"""One rank of ``benchmarks/tiers.py``'s erasure part: one torchrun agent, each rank its own
local directory (one simulated node per rank).

    _tiers_erasure.py OUT CONFIG_JSON

Each rank holds ``mib`` MiB of its own state (``PerRank``, seeded by its rank). Per round, the
settings one after the other (``replicas=1``, then each ``erasure=(k, m)``: ABAB across rounds),
each on fresh directories: a warm-up save, then the time to a locally committed (node-loss-safe)
step; the node-local bytes of that step (its step directory and the parity the node holds) over
the bytes the node's rank wrote; then node 1's directory deleted (a node replaced by an empty
one) and the time of ``restore()`` on new managers (the lost files made whole from a replica,
or rebuilt from parity), checked bit for bit with no read from the persistent root. For each
code, rank 0 then times a raw encode of the same bytes in memory with the same library
(``tiers/erasure.py``: XOR for m = 1, zfec for m >= 2): one group's k states, every parity
shard, in the tier's pieces. Writes ``OUT/erasure-r<rank>.json``: every sample.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.tiers.erasure import PIECE_BYTES, Code
from shardkeeper.core.tiers.placement import PARITY_DIR


def state_of(rank: int, mib: int) -> torch.Tensor:
    return torch.randn((mib << 20) // 4, generator=torch.Generator().manual_seed(rank))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def raw_encode(k: int, m: int, mib: int) -> float:
    """Seconds to code the states of ranks 0..k-1 (one group's bytes) into m parity shards, in
    the tier's pieces, in memory."""
    code = Code(k, m)
    data = [state_of(r, mib).numpy().view(np.uint8) for r in range(k)]
    t0 = time.perf_counter()
    for off in range(0, len(data[0]), PIECE_BYTES):
        code.encode([d[off : off + PIECE_BYTES] for d in data])
    return time.perf_counter() - t0


def cycle(base: Path, extra: dict[str, Any], value: torch.Tensor) -> dict[str, Any]:
    """One setting on fresh directories: commit time, node bytes / own bytes, restore after
    node 1's loss."""
    rank = dist.get_rank()
    root, local = base / "root", base / f"node{rank}"
    opts = {"local": local, "local_keep": 1, "commit_timeout_s": 600, **extra}
    state = {"own": PerRank(value)}
    mgr = CheckpointManager(root, **opts)
    mgr.save(1, state).wait()  # warm-up: the staging buffer, the plan and the parity's groups are made once
    dist.barrier()
    t0 = time.perf_counter()
    mgr.save(2, state).wait()
    commit_s = time.perf_counter() - t0
    mgr.close()
    own = sum(p.stat().st_size for p in (local / step_dir(2) / "data").glob(f"r{rank:05d}-*"))
    held = tree_bytes(local / step_dir(2)) + tree_bytes(local / PARITY_DIR / step_dir(2))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)  # node 1 replaced by an empty one
    dist.barrier()
    target = {"own": PerRank(torch.zeros_like(value))}
    mgr = CheckpointManager(root, **opts)
    dist.barrier()
    t0 = time.perf_counter()
    got = mgr.restore(target)
    restore_s = time.perf_counter() - t0
    exact = got == 2 and torch.equal(target["own"].value, value)
    ok = exact and mgr.last_restore_tier == "local" and mgr.persistent_reads == 0
    mgr.close()
    return {"commit_s": commit_s, "restore_s": restore_s, "memory": held / own, "ok": ok}


def main() -> None:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = state_of(rank, cfg["mib"])
    base = Path(cfg["dir"])
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cfg["settings"]}
    for rnd in range(cfg["rounds"]):
        for i, (name, extra) in enumerate(cfg["settings"]):
            work = base / f"r{rnd}-s{i}"
            code = extra.get("erasure")
            got = cycle(work, {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}, value)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(work, ignore_errors=True)
                if code:
                    got["encode_s"] = raw_encode(code[0], code[1], cfg["mib"])
            dist.barrier()
            samples[name].append(got)
    (out / f"erasure-r{rank}.json").write_text(json.dumps(samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
