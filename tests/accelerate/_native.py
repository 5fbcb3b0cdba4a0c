"""A folder written by Accelerate's own ``save_state`` (safetensors + pickles), for import tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def native_folder(tmp_path: Path, name: str) -> tuple[Any, Any, Any, Path]:
    """A fresh CPU Accelerator with a prepared Linear(3, 2) and Adam after one step, and the
    folder its native ``save_state`` wrote: ``(accelerator, model, optimizer, folder)``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    lin = nn.Linear(3, 2)
    model, opt = acc.prepare(lin, torch.optim.Adam(lin.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 3)).sum())
    opt.step()
    folder = tmp_path / name
    Accelerator.save_state(acc, str(folder))  # Accelerate's format: safetensors + pickles
    return acc, model, opt, folder
