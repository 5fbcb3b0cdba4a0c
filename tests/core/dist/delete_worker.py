"""``delete(step, damaged=True)`` as a collective on a real process group (tests/core/lifecycle/test_delete_damaged.py).

    delete_worker.py ROOT OUT_DIR

The coordinator verifies and deletes; every rank must raise what it raised, with its reason:
a step that is intact, one that has no manifest, and then one that is damaged (deleted, True
everywhere). Each rank writes what it saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from seen import finish

from shardkeeper.core import CheckpointManager


def _outcome(fn) -> list[str]:  # type: ignore[no-untyped-def]
    try:
        return ["returned", repr(fn())]
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return [type(e).__name__, str(e)]


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    seen: dict[str, object] = {"rank": rank}
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.arange(64, dtype=torch.float32) + step}).wait()
        seen["intact"] = _outcome(lambda: mgr.delete(2, damaged=True))
        seen["missing"] = _outcome(lambda: mgr.delete(7, damaged=True))
        dist.barrier()
        if rank == 0:  # one byte of the data file flipped (a replicated tensor: rank 0 writes it)
            (data,) = sorted((Path(root) / "step-000000000002" / "data").glob("r*"))
            raw = bytearray(data.read_bytes())
            raw[-1] ^= 0x01
            data.write_bytes(bytes(raw))
        dist.barrier()
        seen["damaged"] = _outcome(lambda: mgr.delete(2, damaged=True))
        seen["steps"] = mgr.steps()
    # A root whose name holds a byte that is not UTF-8: its reason still reaches every rank.
    with CheckpointManager(os.path.join(root, "odd-\udcff-name")) as mgr:
        mgr.save(1, {"w": torch.zeros(4)}).wait()
        seen["odd root"] = _outcome(lambda: mgr.delete(1, damaged=True))
    finish(out, rank, seen)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
