"""Host memory held across repeated saves of one CUDA state (the third part of benchmarks/gpu.py).

    python benchmarks/gpu_memory.py --out FILE [--size-mib 512] [--saves 10] [--device cuda]

One process (a one-rank gloo group, for DCP), a stack of ``nn.Linear`` layers plus AdamW
state of about ``--size-mib`` on the device, one optimizer step between saves. Each method
saves ``--saves`` times, waiting for each save to end; after every save (``gc.collect()``
first) it records the process RSS, the bytes torch's pinned allocator holds
(``torch.cuda.host_memory_stats()``, where this torch has it) and shardkeeper's staging
buffer (its size and how it is pinned). Methods: ``sk_blocking``, ``sk_overlap`` and
``sk_process`` (``writer="process"``: also its persist process's RSS; one ``CheckpointManager``
each, async saves), ``dcp_pinned`` (``dcp.async_save`` with one reused
``DefaultStager(StagingOptions(use_pinned_memory=True, ...))``). Growth = the last save's
figure minus the second's (the first allocates the buffers). Writes one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _proc import rss_bytes  # noqa: E402

METHODS = ("sk_blocking", "sk_overlap", "sk_process", "dcp_pinned")


def _rss_of(pid: int | None) -> int | None:
    """Another process's RSS (a persist process's), None when it is gone or unreadable."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pinned_allocator_bytes(torch: Any) -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        value = stats().get("allocated_bytes.current")  # the host allocator's name (not .all.)
        return None if value is None else int(value)
    except RuntimeError:  # a torch without the stats for this allocator
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _dcp_stager import ReusableStager
    from torch.distributed.checkpoint.staging import StagingOptions

    from shardkeeper.core import CheckpointManager

    dev = torch.device(args.device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    work = Path(tempfile.mkdtemp(prefix="sk-gpu-mem-", dir=args.workdir))
    try:
        dim = 1024
        layers = max(1, int(args.size_mib * (1 << 20) / (12 * dim * dim)))  # params + 2 AdamW moments
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers))).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(8, dim, device=dev)

        def step() -> None:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
        out: dict[str, Any] = {"state_bytes": state_bytes, "saves": args.saves, "device": str(dev), "methods": {}}
        for method in METHODS:
            rows: list[dict[str, Any]] = []
            mgr = None
            stager = None
            if method.startswith("sk_"):
                if method == "sk_process":  # the staging buffer is shared memory, mapped by a persist process
                    mgr = CheckpointManager(work / method, staging="blocking", writer="process")
                else:
                    mgr = CheckpointManager(work / method, staging=method.removeprefix("sk_"))
            else:
                stager = ReusableStager(
                    StagingOptions(
                        use_pinned_memory=dev.type == "cuda",
                        use_shared_memory=False,
                        use_async_staging=False,
                        use_non_blocking_copy=dev.type == "cuda",
                    )
                )
            t0 = time.perf_counter()
            for n in range(1, args.saves + 1):
                step()
                if mgr is not None:
                    mgr.save(n, {"model": model, "optim": opt}).wait()
                    shutil.rmtree(mgr.step_url(n), ignore_errors=True)
                else:
                    resp = dcp.async_save(
                        {"model": model.state_dict(), "optim": opt.state_dict()},
                        checkpoint_id=str(work / f"dcp-{n}"),
                        async_stager=stager,
                    )
                    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
                    shutil.rmtree(work / f"dcp-{n}", ignore_errors=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                gc.collect()
                row: dict[str, Any] = {"save": n, "rss_bytes": rss_bytes()}
                row["pinned_allocator_bytes"] = _pinned_allocator_bytes(torch)
                if stager is not None:
                    row["dcp_stager_refills"] = stager.refills  # see _dcp_stager.py
                if mgr is not None:
                    st = mgr._stager
                    row["staging_buffer_bytes"] = st.buffer_bytes
                    row["pinned_how"] = st.pinned_how
                    row["persist_rss_bytes"] = _rss_of(getattr(mgr._saver, "pid", None))
                rows.append(row)
            if mgr is not None:
                mgr.close()
            if stager is not None:
                stager.close_now()
            second, last = rows[min(1, len(rows) - 1)], rows[-1]
            growth = {
                k: (last[k] - second[k]) if isinstance(last.get(k), int) and isinstance(second.get(k), int) else None
                for k in ("rss_bytes", "pinned_allocator_bytes")
            }
            out["methods"][method] = {"samples": rows, "growth": growth, "seconds": time.perf_counter() - t0}
        out["torch"] = torch.__version__
        return out
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size-mib", type=float, default=512.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    Path(args.out).write_text(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
