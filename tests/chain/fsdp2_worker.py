"""Hop 2: plain torch FSDP2 (``fully_shard``, world size 3) with the core ``CheckpointManager``:
restore the newest step, train 2 more steps, save at the restored step + 2.

    fsdp2_worker.py ROOT OUT
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402
from tests.chain.common import MOMENTS, Hop, Net, adam, loss_of, record, run_hop  # noqa: E402

STEPS = 2


def full_record(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full parameters, moments and Adam step by FQN, gathered from the DTensor shards."""
    params, states = {}, {}
    for n, p in model.named_parameters():
        params[n] = p.full_tensor()
        st = opt.state.get(p, {})
        states[n] = {k: st[k].full_tensor() for k in MOMENTS if k in st}
        if "step" in st:
            states[n]["step"] = st["step"]
    return record(params, states)


def run(hop: Hop, root: str) -> None:
    torch.manual_seed(100 + hop.index)  # other initial values than the saver's: the restore must matter
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adam(model.parameters())
    with CheckpointManager(root) as mgr:
        newest = mgr.latest_step()
        step = mgr.restore({"model": model, "optim": opt}, only=["model/*", "optim/*"])  # returns the step
        hop.loaded(step, full_record(model, opt))
        hop.counter("the step restore() returns (the loop's counter)", step, newest)
        for k in range(STEPS):
            opt.zero_grad()
            loss_of(model, step + k, dist.get_rank()).backward()
            opt.step()
        step += STEPS
        before = mgr.steps()
        mgr.save(step, {"model": model, "optim": opt}).wait()
        hop.saved(before, mgr.steps(), newest + STEPS, full_record(model, opt), "restored step + 2")


def _teardown() -> None:
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_hop("fsdp2", run, setup=lambda: dist.init_process_group("gloo"), teardown=_teardown)
