"""Parallel layouts for the multi-process tests: one small model, five ways to distribute it.

Each builder returns ``(model, optimizer)`` for this rank. ``plain`` is DDP under a process
group and a bare module in one process; ``fsdp1`` uses FSDP1 in sharded-state-dict mode
(the only FSDP1 mode that runs on CPU); ``fsdp2``, ``tp`` and ``fsdp2_tp`` use DTensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

LAYOUTS = ("plain", "fsdp1", "fsdp2", "tp", "fsdp2_tp")


class Net(nn.Module):
    """Sizes chosen so that FSDP shards at world size 3 are uneven (20 rows over 3 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(12, 20)
        self.fc1 = nn.Linear(20, 36)
        self.fc2 = nn.Linear(36, 20)
        self.head = nn.Linear(20, 5)
        # 3 MiB of weights: its shards are large enough for restore's direct-read path
        # (overlaps of 1 MiB and more), and resharding them cuts through digest blocks.
        self.big = nn.Linear(512, 1536)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.emb(x))
        h = torch.relu(self.fc1(h))
        h = torch.relu(self.fc2(h))
        side = self.big(torch.ones(1, 512) * x.mean()).mean()
        return self.head(h) * self.scale + side


def supported(layout: str, world: int) -> bool:
    if layout in ("tp",):
        return world >= 2
    if layout == "fsdp2_tp":
        return world >= 4 and world % 2 == 0
    if layout in ("fsdp1",):
        return world >= 2
    return True


def build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if distributed else 1
    if layout == "plain":
        if distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
    elif layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    elif layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (model.emb, model.fc1, model.fc2, model.head, model.big):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("tp", "fsdp2_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if layout == "tp":
            tp_mesh = init_device_mesh("cpu", (world,))
        else:
            mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            tp_mesh = mesh2d["tp"]
        parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if layout == "fsdp2_tp":
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh2d["dp"]
            for m in (model.emb, model.fc1, model.fc2, model.head, model.big):
                fully_shard(m, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
    else:
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (so every layout computes the same thing)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    x, y = batch(i)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as full tensors, keyed canonically (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from shardkeeper.core.state.flatten import normalize_fqn

    opts = StateDictOptions(full_state_dict=True)
    out: dict[str, torch.Tensor] = {}
    for k, v in get_model_state_dict(model, options=opts).items():
        out[f"model/{normalize_fqn(k)}"] = _full(v)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim/state/{normalize_fqn(str(fqn))}/{name}"] = _full(v)
    return out


def _full(v: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.detach().clone().contiguous()
