"""Row-sharded DTensor state with AdamW at world size 2 on gloo, with tensors on the device.

    dtensor_worker.py OUT

Run under torchrun with 2 ranks. On a GPU both ranks use ``cuda:0`` (NCCL refuses two ranks
on one device; gloo takes CUDA tensors); in the dry run, the CPU. Every parameter is a
DTensor over ``init_device_mesh(device_type, (2,))`` holding one row shard (``Shard(0)``)
per rank, made with ``DTensor.from_local(..., run_check=False)``, and AdamW's state lives on
those DTensors. Gradients are set per rank as DTensors from a seeded generator, so no
collective runs on a CUDA tensor in this script (shardkeeper coordinates through the c10d
store and a CPU broadcast).

Each rank saves step 3, then restores it into a fresh sharded model and optimizer and
compares its local shards bit for bit; it writes its local shards as saved to
``OUT/ref-r<R>.safetensors`` (the test concatenates them for the resharded restore at world
size 1) and its checks to ``OUT/r<R>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from shardkeeper.core import CheckpointManager
from tests.checks import Checks
from tests.cuda._device import join_gloo_on_the_device, leave_gloo
from tests.cuda._model import Net

WORLD = 2


def sharded(seed: int, device: torch.device, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The full model of ``seed`` (the same on every rank), each parameter replaced by this
    rank's row shard as a DTensor."""
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(seed)
    model = Net().to(device)
    rank = dist.get_rank()
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            local = p.detach().chunk(WORLD, dim=0)[rank].clone()
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            mod._parameters[name] = nn.Parameter(dt)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def sharded_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, mesh: Any) -> None:
    """One AdamW step on per-rank gradients drawn from a seeded generator (no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    for p in model.parameters():
        local = p.to_local()
        grad = torch.randn(local.shape, generator=g).to(local.dtype).to(local.device)
        p.grad = DTensor.from_local(grad, mesh, [Shard(0)], run_check=False)
    opt.step()
    opt.zero_grad()


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's parameters, buffers and optimizer state tensors as local CPU copies, keyed
    as ``tests.checks.state_of`` keys them."""
    out: dict[str, torch.Tensor] = {}
    names = {}
    for n, p in model.named_parameters():
        out[f"param/{n}"] = p.to_local().detach().cpu().clone()
        names[id(p)] = n
    for n, b in model.named_buffers():
        out[f"buffer/{n}"] = b.detach().cpu().clone()
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                out[f"optim/{names[id(p)]}/{k}"] = t.detach().cpu().clone()
    return out


def on_device(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> bool:
    locals_ = [p.to_local() for p in model.parameters()]
    locals_ += [v.to_local() for st in opt.state.values() for v in st.values() if hasattr(v, "to_local")]
    return all(t.device == device for t in locals_)


def main() -> None:
    out = Path(sys.argv[1])
    rank, device = join_gloo_on_the_device()
    checks = Checks(rank=rank)
    try:

        def case() -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor

            mesh = init_device_mesh(device.type, (WORLD,))
            model, opt = sharded(21, device, mesh)
            for i in range(3):
                sharded_step(model, opt, i, mesh)
            checks.check("parameters are DTensors", all(isinstance(p, DTensor) for p in model.parameters()))
            checks.check(
                "AdamW state is on DTensors",
                all(isinstance(st["exp_avg"], DTensor) for st in opt.state.values()),
            )
            checks.check("trained state is on the device", on_device(model, opt, device))
            ref = local_state(model, opt)
            save_file(ref, str(out / f"ref-r{rank}.safetensors"))
            with CheckpointManager(out / "ckpt", process_group=dist.group.WORLD) as mgr:
                mgr.save(3, {"model": model, "optim": opt}).wait()
                sharded_step(model, opt, 7, mesh)
                checks.check("the live state moved on (control)", not torch.equal(
                    local_state(model, opt)["param/fc1.weight"], ref["param/fc1.weight"]))
                model2, opt2 = sharded(77, device, mesh)
                sharded_step(model2, opt2, 99, mesh)  # the optimizer state the restore fills
                mgr.restore({"model": model2, "optim": opt2}, step=3)
                checks.check("restored shards stay on the device", on_device(model2, opt2, device))
                checks.same("restore at world size 2 is bit for bit", local_state(model2, opt2), ref)
            checks.check("committed", mgr.steps() == [3], str(mgr.steps()))

        checks.run("sharded save and restore", case)
    finally:
        leave_gloo(checks, out / f"r{rank}.json")


if __name__ == "__main__":
    main()
