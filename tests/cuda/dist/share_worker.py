"""Replica-deduplicated restore into state on the device, at world size 2 on gloo.

    share_worker.py OUT

Run under torchrun with 2 ranks, both on ``cuda:0`` (the CPU in the dry run). Every rank holds
the same model, AdamW state and a 4 MiB float32 table on the device, as under DDP
(replication 2). Both save step 2; then each restores it into fresh state on the device
twice: with ``share_restore_reads`` on (each replicated byte read from storage by one rank
and sent to the other over the restore's own gloo group, then copied to the device) and off
(the control: each rank reads everything). Checked: bit for bit both times, the restored
tensors stay on the device, and the bytes read from storage summed over the ranks are at
most 1.05 x the bytes the step's data files hold when shared (at least 1.8 x when not).
Rank 0 writes the ratios to ``OUT/ratios.json``; every rank its checks to ``OUT/r<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager
from tests.checks import Checks, state_of
from tests.cuda._device import join_gloo_on_the_device, leave_gloo
from tests.cuda._model import devices_of, fresh, trained


def summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)  # gloo, on the CPU
    return int(t.item())


def main() -> None:
    out = Path(sys.argv[1])
    rank, device = join_gloo_on_the_device()
    checks = Checks(rank=rank)
    ckpt = out / "ckpt"
    try:

        def case() -> None:
            model, opt = trained(5, device)
            table = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(7)).to(device)
            want = {**state_of(model, opt), "table": table.cpu().clone()}
            with CheckpointManager(ckpt) as mgr:
                mgr.save(2, {"model": model, "optim": opt, "extra": {"table": table}}).wait()
            held = sum(f.stat().st_size for f in (ckpt / "step-000000000002" / "data").iterdir())
            ratios = {}
            for share in (True, False):
                name = "shared" if share else "not shared"
                model2, opt2 = fresh(device)
                table2 = torch.zeros_like(table)
                before = devices_of(model2, opt2)
                with CheckpointManager(ckpt, share_restore_reads=share) as mgr:
                    got = mgr.restore({"model": model2, "optim": opt2, "extra": {"table": table2}})
                    st = mgr.last_restore_stats
                assert st is not None
                checks.check(f"{name}: step 2 restored", got == 2, got)
                checks.check(f"{name}: restored tensors stay on the device", devices_of(model2, opt2) == before
                             and table2.device == device)  # fmt: skip
                checks.same(f"{name}: bit for bit", {**state_of(model2, opt2), "table": table2.cpu()}, want)
                ratio = summed(st.bytes_read) / held
                received = summed(st.bytes_received)
                ratios[name] = round(ratio, 4)
                if share:
                    checks.check(f"{name}: read <= 1.05 x the checkpoint", ratio <= 1.05, f"ratio {ratio:.4f}")
                    checks.check(f"{name}: the peer sent bytes", received > 0, f"received {received}")
                else:
                    checks.check(f"{name}: every rank read it all (control)", ratio >= 1.8, f"ratio {ratio:.4f}")
                    checks.check(f"{name}: nothing received", received == 0, f"received {received}")
            if rank == 0:
                (out / "ratios.json").write_text(json.dumps({**ratios, "checkpoint_bytes": held}))

        checks.run("replica-deduplicated restore on the device", case)
    finally:
        leave_gloo(checks, out / f"r{rank}.json")


if __name__ == "__main__":
    main()
