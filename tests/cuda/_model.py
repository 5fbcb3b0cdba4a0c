"""The small model the CUDA tests train and checkpoint, on any device.

Linear + LayerNorm + Linear in float32, a bfloat16 parameter and a bfloat16 buffer (the
format stores each dtype's bytes as they are), trained with AdamW. Batches are drawn on the
CPU from a seeded generator and moved, so every device sees the same inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4).to(torch.bfloat16))
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 4).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.ln(self.fc1(x))))
        return h * self.scale.float() + self.offset.float()


def build(seed: int, device: Any) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def fwd_bwd(model: nn.Module, i: int) -> None:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(i)
    model(torch.randn(8, 16, generator=g).to(device)).pow(2).mean().backward()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    fwd_bwd(model, i)
    opt.step()
    opt.zero_grad()


def trained(seed: int, device: Any, steps: int = 3) -> tuple[Net, torch.optim.Optimizer]:
    model, opt = build(seed, device)
    for i in range(steps):
        train_step(model, opt, 100 * seed + i)
    return model, opt


def fresh(device: Any, seed: int = 99) -> tuple[Net, torch.optim.Optimizer]:
    """A model and optimizer with other values, whose optimizer state exists (a restore fills it)."""
    model, opt = build(seed, device)
    train_step(model, opt, 12345)
    return model, opt


def devices_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.device]:
    """The device of every parameter, buffer and optimizer state tensor, by name."""
    out = {f"param/{n}": p.device for n, p in model.named_parameters()}
    out.update({f"buffer/{n}": b.device for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = v.device
    return out
