"""The training states the benchmark saves and restores.

- ``FsdpState``: a stack of ``nn.Linear(d, d)`` layers under FSDP2 (``fully_shard`` per layer,
  then the root) with AdamW state after one optimizer step, sized so that parameters +
  ``exp_avg`` + ``exp_avg_sq`` (about 3x the parameters) come to the target bytes per rank.
  Built on the meta device and materialized shard by shard, so no rank ever holds the full
  model.
- ``SmallState``: a plain dict of many small float32 tensors (the "10,000 small tensors" case).

Both expose ``local_tensors()``: the tensors this rank holds (local shards), keyed like the
canonical state, which the raw anchors (copy, write, read, digest) and the torch.save anchor
use, and ``state_bytes``, their total size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

N_LAYERS = 8
PARTIAL_LAYER = 3  # case (d) restores only model/layers.3.*


class Stack(nn.Module):
    def __init__(self, n_layers: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def dim_for(size_mib: float, world_save: int = 2, n_layers: int = N_LAYERS) -> int:
    """Hidden size d so that 3 x (params of n_layers Linear(d, d)) / world_save ~ size_mib.

    A multiple of 6, so that the rows shard evenly at world size 1, 2 and 3.
    """
    target = size_mib * (1 << 20) * world_save / (3 * 4 * n_layers)  # d*d + d ~ target
    d = int((-1 + math.sqrt(1 + 4 * target)) / 2)
    return max(6, d - d % 6)


def _to_local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class FsdpState:
    model: nn.Module
    optim: torch.optim.Optimizer
    dim: int
    n_layers: int
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, size_mib: float, *, world_save: int = 2, seed: int = 0) -> FsdpState:
        from torch.distributed.fsdp import fully_shard

        dim = dim_for(size_mib, world_save)
        with torch.device("meta"):
            model = Stack(N_LAYERS, dim)
        if dist.is_initialized():
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        model.to_empty(device="cpu")
        rank = dist.get_rank() if dist.is_initialized() else 0
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        bound = 1.0 / math.sqrt(dim)
        with torch.no_grad():
            for p in model.parameters():
                _to_local(p).uniform_(-bound, bound, generator=gen)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # One optimizer step, so that exp_avg and exp_avg_sq exist (gradients: a scaled copy
        # of the parameters; their values do not matter for checkpoint speed).
        for p in model.parameters():
            p.grad = p.detach() * 0.01
        optim.step()
        optim.zero_grad(set_to_none=True)
        st = cls(model, optim, dim, N_LAYERS)
        st.info = {"kind": "fsdp2", "dim": dim, "n_layers": N_LAYERS, "world_save": world_save}
        return st

    def sk_state(self) -> dict[str, Any]:
        """What a shardkeeper user passes: the module and the optimizer themselves."""
        return {"model": self.model, "optim": self.optim}

    def dcp_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a DCP user does first: ``get_state_dict(model, optimizer)``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optim)

    def dcp_set(self, msd: dict[str, Any], osd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=msd, optim_state_dict=osd)

    def local_tensors(self) -> dict[str, torch.Tensor]:
        msd, osd = self.dcp_state_dicts()
        out = {f"model/{k}": _to_local(v) for k, v in msd.items()}
        for fqn, per in osd["state"].items():
            for name, v in per.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/state/{fqn}/{name}"] = _to_local(v)
        return out

    def torch_payload(self) -> dict[str, Any]:
        """The rank's local shard state dict for torch.save (tensors + param_groups)."""
        msd, osd = self.dcp_state_dicts()
        return {
            "model": {k: _to_local(v) for k, v in msd.items()},
            "optim": {
                "state": {f: {n: _to_local(v) for n, v in per.items()} for f, per in osd["state"].items()},
                "param_groups": osd["param_groups"],
            },
        }

    def torch_apply(self, loaded: dict[str, Any]) -> None:
        """Copy a torch.load'ed local state dict into the live module and optimizer, in place."""
        msd, osd = self.dcp_state_dicts()
        with torch.no_grad():
            for k, v in msd.items():
                _to_local(v).copy_(loaded["model"][k])
            for f, per in osd["state"].items():
                for n, v in per.items():
                    _to_local(v).copy_(loaded["optim"]["state"][f][n])

    def layer_prefix(self) -> str:
        return f"layers.{PARTIAL_LAYER}."

    def partial_bytes(self) -> int:
        p = self.layer_prefix()
        return sum(_to_local(v).nbytes for k, v in self.model.state_dict().items() if k.startswith(p))

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.local_tensors().values())


@dataclass
class SmallState:
    tensors: dict[str, torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, n: int, *, seed: int = 0) -> SmallState:
        """``n`` float32 tensors of 256 to 2,048 elements (1 to 8 KiB), about 4.5 KiB mean."""
        gen = torch.Generator().manual_seed(1234)  # the shapes: the same for every seed
        sizes = torch.randint(256, 2049, (n,), generator=gen).tolist()
        vals = torch.Generator().manual_seed(seed)
        tensors = {f"t{i:05d}": torch.rand(s, generator=vals) for i, s in enumerate(sizes)}
        st = cls(tensors)
        st.info = {"kind": "small", "n_tensors": n}
        return st

    def sk_state(self) -> dict[str, Any]:
        return {"t": self.tensors}

    def local_tensors(self) -> dict[str, torch.Tensor]:
        return {f"t/{k}": v for k, v in self.tensors.items()}

    def torch_payload(self) -> dict[str, Any]:
        return self.tensors

    def torch_apply(self, loaded: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in self.tensors.items():
                v.copy_(loaded[k])

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
