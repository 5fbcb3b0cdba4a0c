"""Save and restore a CUDA model and AdamW through NCCL at world size 1 (gloo in the dry run).

    nccl_worker.py OUT

Run as one plain process (``tests.launch.run_script(1, ...)``): it makes its own one-rank
group on a TCP store at a free port. The save goes through ``process_group`` (the default
group), then the restore into a fresh model and optimizer on the device must be bit for bit.
Writes ``OUT/r0.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager
from tests.checks import Checks, state_of
from tests.cuda._device import on_cpu, test_device
from tests.cuda._model import devices_of, fresh, train_step, trained


def main() -> None:
    out = Path(sys.argv[1])
    checks = Checks(rank=0)
    device = test_device()
    backend = "gloo" if on_cpu() else "nccl"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        checks.check("backend", dist.get_backend() == backend, dist.get_backend())

        def case() -> None:
            model, opt = trained(11, device)
            ref = state_of(model, opt)
            with CheckpointManager(out / "ckpt", process_group=dist.group.WORLD) as mgr:
                mgr.save(3, {"model": model, "optim": opt}).wait()
                train_step(model, opt, 50)
                checks.check("committed", mgr.steps() == [3], str(mgr.steps()))
                model2, opt2 = fresh(device)
                before = devices_of(model2, opt2)
                got_step = mgr.restore({"model": model2, "optim": opt2}, step=3)
                checks.check("restore returns the step", got_step == 3, str(got_step))
                checks.check("restored tensors stay on their devices", devices_of(model2, opt2) == before)
                checks.check("on the device", next(model2.parameters()).device == device)
                checks.same("restore is bit for bit", state_of(model2, opt2), ref)

        checks.run("save and restore", case)
    finally:
        checks.write(out / "r0.json")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
