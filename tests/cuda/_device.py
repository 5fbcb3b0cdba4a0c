"""Which device the CUDA tests use, for the tests and for the scripts they launch.

``cuda:0`` normally. With ``SHARDKEEPER_CUDA_ON_CPU=1`` (the dry run) the same tests run their
logic on the CPU, so that they are known to be right before a GPU ever runs them. Launched
workers inherit the environment, so they choose the same device as the test that started them.
Only the standard library is imported at the top: collection must work without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

ON_CPU_ENV = "SHARDKEEPER_CUDA_ON_CPU"
SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def on_cpu() -> bool:
    """True in the dry run: the CUDA tests run on the CPU."""
    return os.environ.get(ON_CPU_ENV) == "1"


def runnable() -> bool:
    """Whether the CUDA tests can run here: a GPU, or the dry run."""
    if on_cpu():
        return True
    import torch

    return bool(torch.cuda.is_available())


def test_device() -> Any:
    """``torch.device("cuda", 0)``, or ``torch.device("cpu")`` in the dry run."""
    import torch

    return torch.device("cpu") if on_cpu() else torch.device("cuda", 0)


test_device.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def join_gloo_on_the_device() -> tuple[int, Any]:
    """A two-rank worker's start: a gloo process group, one CPU thread, and the test device made
    current on every rank (on a GPU both ranks share ``cuda:0``: NCCL refuses two ranks on one
    device, gloo takes CUDA tensors). Returns this rank and the device."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    device = test_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Initialised before init_device_mesh, which otherwise picks the device itself from
        # LOCAL_RANK (1 on rank 1: no such device on a one-GPU machine).
        torch.zeros(1, device=device)
    return dist.get_rank(), device


def leave_gloo(checks: Any, path: Any) -> None:
    """A two-rank worker's end: its checks written to ``path``, then the ranks leave together."""
    import torch.distributed as dist

    checks.write(path)
    dist.barrier()
    dist.destroy_process_group()
