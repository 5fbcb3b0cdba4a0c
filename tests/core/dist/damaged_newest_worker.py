"""A damaged newest step under a restarted loop on 2 gloo ranks (tests/core/restore/test_damaged_newest.py).

    damaged_newest_worker.py ROOT OUT_DIR

Steps 1-3 are saved; rank 1 then flips a byte of its own per-rank chunk of step 3, which only
rank 1 reads: rank 0's attempt succeeds, so the coordinator can verify the damage only through
the file rank 1's error named. A restarted loop (``start = mgr.restore(state) + 1``) restores
step 2 on every rank, the coordinator quarantines step 3 once, every rank hears it, and the
loop saves steps 3 and 4, which restore bit for bit on both ranks. Each rank writes what it
saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from seen import finish

from shardkeeper.core import CheckpointManager, PerRank


def _state(step: int, rank: int, run: int) -> dict[str, Any]:
    return {
        "w": torch.arange(256, dtype=torch.float32) + step + 1000 * run,
        "mine": PerRank(torch.full((512,), float(step * 10 + rank + 1000 * run))),
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(256), "mine": PerRank(torch.zeros(512))}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return torch.equal(got["w"], want["w"]) and torch.equal(got["mine"].value, want["mine"].value)


def _flip_own_chunk(root: str, rank: int) -> str:
    """Flip one byte in the middle of ``rank``'s per-rank chunk of step 3; its file."""
    step = Path(root, "step-000000000003")
    leaf = json.loads((step / "manifest.json").read_bytes())["leaves"][f"mine/{rank}"]
    c = leaf["chunks"][0]
    path = step / c["file"]
    raw = bytearray(path.read_bytes())
    raw[c["offset"] + c["length"] // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return c["file"]


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    seen: dict[str, Any] = {"rank": rank}
    with CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step, rank, run=0)).wait()
    dist.barrier()
    if rank == 1:
        seen["flipped"] = _flip_own_chunk(root, rank)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(root) as mgr:  # the restarted job
            state = _blank()
            start = mgr.restore(state) + 1
            seen["restored"] = start - 1
            seen["restored_exact"] = _same(state, _state(start - 1, rank, run=0))
            try:
                for step in range(start, 5):
                    mgr.save(step, _state(step, rank, run=1)).wait()
                seen["saved"] = "ok"
            except Exception as e:  # noqa: BLE001 - what each rank saw is the result
                seen["saved"] = f"{type(e).__name__}: {e}"
    seen["warnings"] = [str(w.message) for w in caught if "quarantined" in str(w.message)]
    dist.barrier()
    with CheckpointManager(root) as mgr:
        for step in (3, 4):
            state = _blank()
            try:
                mgr.restore(state, step=step)
                seen[f"step {step} exact"] = _same(state, _state(step, rank, run=1))
            except Exception as e:  # noqa: BLE001 - every rank raises alike (agreed)
                seen[f"step {step} exact"] = f"{type(e).__name__}: {e}"
    finish(out, rank, seen)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
