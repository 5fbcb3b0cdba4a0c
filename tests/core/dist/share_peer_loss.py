"""A rank lost in the middle of a replica-deduplicated restore, on 3 gloo ranks.

    share_peer_loss.py ROOT MODE     (MODE: "exit": rank 1 exits; "hang": rank 1 stops answering)

Every rank holds the same full tensors (replicated, as under DDP), so every read is shared.
Rank 1, when the exchange's first round begins (after the owners' reads), exits at once (with
status 0, so that torchrun leaves the other ranks running) or sleeps past the exchange's
timeout. The survivors must raise a
``CheckpointTimeoutError`` that names the step, their rank and the remedy, within about
``commit_timeout_s`` (here 3 s), not a raw gloo error after the training group's timeout.
Every rank but 1 writes its checks to ``ROOT/results/loss-<MODE>-r<R>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, CheckpointTimeoutError
from shardkeeper.core.restore import share as restore_share
from tests.checks import Checks

ROOT, MODE = Path(sys.argv[1]), sys.argv[2]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = Checks(ROOT / "results" / f"loss-{MODE}-r{rank}.json", rank=rank)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(512, 256, generator=g), "b": torch.randn(4096, generator=g)}
    with CheckpointManager(ROOT / f"ckpt-{MODE}", async_save=False, commit_timeout_s=3.0) as mgr:
        mgr.save(1, state)
        if rank == 1:

            def lost(self: object, *args: object) -> None:
                if MODE == "hang":
                    time.sleep(8)  # past the exchange timeout (3 s)
                os._exit(0)

            restore_share.PeerGroup.all_reduce_max = lost  # type: ignore[method-assign]
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        t0 = time.monotonic()
        try:
            mgr.restore(target, step=1)
        except CheckpointTimeoutError as e:
            waited = time.monotonic() - t0
            msg = str(e)
            checks.check("a CheckpointTimeoutError", True)
            checks.check("it names the step and this rank", f"step 1, rank {rank}" in msg, msg)
            checks.check("it names the remedy", "share_restore_reads=False" in msg, msg)
            checks.check("within about commit_timeout_s", waited < 20.0, f"{waited:.1f} s")
        except Exception as e:  # noqa: BLE001 - recorded: a raw error is the defect this checks
            checks.check("a CheckpointTimeoutError", False, f"{type(e).__name__}: {e}")
        else:
            checks.check("a CheckpointTimeoutError", False, "the restore succeeded without rank 1")
        checks.write()
        os._exit(0)  # the training group has lost a rank: no clean teardown to wait for


if __name__ == "__main__":
    main()
