"""What logical digests cost on the device (the fourth part of benchmarks/gpu.py).

    python benchmarks/gpu_logical.py --out FILE [--mib 1024] [--device cuda] [--repeats 5]

For each case, the partial sums of its shards computed on the device by torch ops
(``shardkeeper.core.state.logical_torch.device_partials``), against a raw device-to-host copy
of the same bytes into a reused pinned buffer, and the numpy path over that host copy
(``format.logical.box_sum``, what a save computes from its staged bytes): medians of
``--repeats`` timed runs after a warm-up, in seconds and seconds per GiB, the device path's
peak extra device memory, and whether its sums equal the numpy path's. Cases: ``whole``, one
bfloat16 tensor of ``--mib``; ``column``, a float32 column shard of ``--mib`` (half the
columns of a tensor twice its size: not contiguous); ``odd_rows``, a float32 column shard of
a tensor whose rows are not whole blocks of lanes (each lane's term on its own), of ``--mib / 8``;
``small``, 10,000 tensors of 64 float32 each. With ``--device cpu`` the "device" is the
CPU: the torch path against the numpy path in host memory. Writes one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "packages" / "core" / "src"))

Shard = tuple[Any, tuple[int, ...], tuple[int, ...]]


def cases(torch: Any, dev: Any, mib: float) -> dict[str, list[Shard]]:
    g = torch.Generator(device=dev).manual_seed(0)
    n = int(mib * (1 << 20))

    def rand(shape: tuple[int, ...], dtype: Any) -> Any:
        return torch.randn(shape, generator=g, device=dev).to(dtype)

    whole = rand((max(1, n // 2 // 4096), 4096), torch.bfloat16)
    rows = max(1, n // (4096 * 4))
    wide = rand((rows, 8192), torch.float32)
    odd_rows = max(1, n // 8 // (3000 * 4))
    odd = rand((odd_rows, 3001), torch.float32)
    small = [rand((64,), torch.float32) for _ in range(10_000)]
    return {
        "whole": [(whole, tuple(whole.shape), (0, 0))],
        "column": [(wide[:, 4096:], tuple(wide.shape), (0, 4096))],
        "odd_rows": [(odd[:, 1:], tuple(odd.shape), (0, 1))],
        "small": [(t, (64,), (0,)) for t in small],
    }


def median_time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: buffers, kernels, weights
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(torch: Any, shards: list[Shard], chunk: int, sync: Callable[[], None], repeats: int) -> dict[str, Any]:
    """One case's figures (see the module's docstring)."""
    from shardkeeper.core.format import logical
    from shardkeeper.core.state.logical_torch import device_partials

    dev = shards[0][0].device
    cuda = dev.type == "cuda"
    nbytes = sum(t.numel() * t.element_size() for t, _, _ in shards)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t, _, _ in shards]

    def copy() -> None:
        for h, (t, _, _) in zip(host, shards):
            h.copy_(t, non_blocking=True)

    boxes = [
        (h.reshape(-1).view(torch.uint8).numpy().data, h.element_size(), logical.Box(s, o, tuple(h.shape)))
        for h, (_, s, o) in zip(host, shards)
    ]
    device_s = median_time(lambda: device_partials(shards, chunk), sync, repeats)
    copy_s = median_time(copy, sync, repeats)
    numpy_s = median_time(lambda: logical.box_sums(boxes), sync, repeats)
    peak = None
    sync()
    if cuda:
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    got = device_partials(shards, chunk)
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) - base
    gib = nbytes / (1 << 30)
    return {
        "bytes": nbytes,
        "shards": len(shards),
        "device_s": device_s,
        "raw_copy_s": copy_s,
        "host_numpy_s": numpy_s,
        "device_s_per_gib": device_s / gib,
        "raw_copy_s_per_gib": copy_s / gib,
        "host_numpy_s_per_gib": numpy_s / gib,
        "device_per_raw_copy": device_s / copy_s if copy_s else None,
        "peak_extra_device_bytes": peak,
        "equal": got == logical.box_sums(boxes),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shardkeeper.core.state.logical_torch import CHUNK_BYTES, CPU_CHUNK_BYTES

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    chunk = int(args.chunk_mib * (1 << 20)) if args.chunk_mib else CHUNK_BYTES if cuda else CPU_CHUNK_BYTES

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    out: dict[str, Any] = {"device": str(dev), "chunk_bytes": chunk, "repeats": args.repeats, "cases": {}}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(dev)
    for name, shards in cases(torch, dev, args.mib).items():
        out["cases"][name] = measure(torch, shards, chunk, sync, args.repeats)
        print(name, json.dumps(out["cases"][name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=float, default=1024.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, default=0.0, help="the pieces' size (default: the module's)")
    args = ap.parse_args()
    Path(args.out).write_text(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
