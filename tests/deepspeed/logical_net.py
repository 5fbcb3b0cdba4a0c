"""The model of the ZeRO logical-digest matrix, built both in the workers and in the test."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    """Parameter sizes 35, 5, 15, 3: uneven over 2 ranks' flat partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))
