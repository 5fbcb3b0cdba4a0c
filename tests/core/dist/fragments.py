"""ZeRO-style flat partitions for the layout matrix: ``Fragment`` leaves at any world size.

Every tensor of ``tensors()`` is flattened into one buffer, padded to a multiple of the
world size and cut into equal partitions, one per rank, as DeepSpeed ZeRO-1/2 does; a
tensor's fragment on a rank is its part of that rank's partition (often empty, sometimes a
range that starts and ends mid-row). Each fragment names its partition (its tensor's place
in the buffer and the partition size), so that saves may record it by the flat rule.
"""

from __future__ import annotations

import math

import torch

from shardkeeper.core import Fragment


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "model/a.weight": torch.randn(7, 5, generator=g),
        "model/b.weight": torch.randn(3, 4, 6, generator=g),
        "model/c.bias": torch.randn(11, generator=g),
        "model/scalar": torch.randn((), generator=g),
        "optim/state/a.weight/exp_avg": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "model/big.weight": torch.randn(300, 1001, generator=g),  # resharded reads go direct
    }


def partition(world: int, rank: int, fill: bool) -> tuple[dict[str, Fragment], dict[str, torch.Tensor]]:
    """This rank's fragments (filled with the values, or with NaN/zero for a restore target),
    and the flat buffers that hold them (one per dtype)."""
    ts = tensors()
    frags: dict[str, Fragment] = {}
    buffers: dict[str, torch.Tensor] = {}
    for dtype in sorted({t.dtype for t in ts.values()}, key=str):
        keys = [k for k, t in ts.items() if t.dtype == dtype]
        total = sum(ts[k].numel() for k in keys)
        part = math.ceil(total / world)
        lo, hi = rank * part, (rank + 1) * part
        buf = torch.full((part,), float("nan")).to(dtype)
        pos = 0
        for k in keys:
            n = ts[k].numel()
            s, e = max(pos, lo), min(pos + n, hi)
            if s < e or n == 0:
                local = buf[max(s - lo, 0) : max(e - lo, 0)] if s < e else buf[:0]
                if fill and s < e:
                    local.copy_(ts[k].reshape(-1)[s - pos : e - pos])
                frags[k] = Fragment(local, ts[k].shape, s - pos if s < e else 0, partition=(pos, part))
            else:
                frags[k] = Fragment(buf[:0], ts[k].shape, 0, partition=(pos, part))
            pos += n
        buffers[str(dtype)] = buf
    return frags, buffers


def gather(frags: dict[str, Fragment]) -> dict[str, torch.Tensor]:
    """The full tensors from every rank's fragments (a collective when distributed)."""
    import torch.distributed as dist

    out = {}
    for k, f in frags.items():
        full = torch.zeros(math.prod(f.global_shape), dtype=torch.float64)
        full[f.offset : f.offset + f.numel] = f.local.double()
        if dist.is_initialized():
            dist.all_reduce(full)
        out[k] = full.to(f.dtype).reshape(f.global_shape)
    return out
