"""Quantized optimizer state: bytes saved and the loss after resume, against an exact resume.

    python benchmarks/quantized.py                 # 50 + 50 steps, a ~2.4M-parameter MLP
    python benchmarks/quantized.py --steps 20 --quick

One process, CPU. A small MLP regression task is trained with AdamW for ``--steps`` steps and
saved three ways (exact, ``quantized(mode="bf16")``, ``quantized(mode="int8")``); each is
restored into a fresh model and optimizer and trained ``--steps`` more on the same batches as
the uninterrupted run. Reported: bytes of the Adam moments and of the whole checkpoint as
stored, and the loss after resume (final, and the mean gap to the uninterrupted run). Results
go to benchmarks/results/quantized-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.state.quantize import quantized
from shardkeeper.core.storage import open_storage

HERE = Path(__file__).resolve().parent


def build(width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + i)
    x = torch.randn(256, 64, generator=g)
    w = torch.linspace(-1, 1, 64 * 16).reshape(64, 16) / 8
    return x, torch.sin(x @ w) + 0.05 * torch.randn(256, 16, generator=g)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    x, y = batch(i)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def stored_bytes(root: Path, step_: int) -> tuple[int, int]:
    m = load_manifest(open_storage(str(root)), step_)
    moments = sum(
        c.length
        for k in m.leaves
        if k.startswith("optim/state/") and m.leaves[k].kind == "tensor"
        for c in m.leaves[k].chunks
    )
    return moments, sum(int(f["size_bytes"]) for f in m.files.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="steps before the save and after the resume")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="do not write results files")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.steps
    model, opt = build(args.width, 0)
    for i in range(n):
        step(model, opt, i)
    ref_model, ref_opt = build(args.width, 0)
    uninterrupted = [step(ref_model, ref_opt, i) for i in range(2 * n)][n:]
    work = Path(tempfile.mkdtemp(prefix="sk-quant-"))
    rows: list[dict[str, Any]] = []
    try:
        for mode in ("exact", "bf16", "int8"):
            root = work / mode
            entry: Any = opt if mode == "exact" else quantized(opt, model, mode=mode)
            with CheckpointManager(root) as mgr:
                mgr.save(n, {"model": model, "optim": entry}, async_save=False)
            moments, total = stored_bytes(root, n)
            m2, o2 = build(args.width, 99)
            entry2: Any = o2 if mode == "exact" else quantized(o2, m2, mode=mode)
            with CheckpointManager(root) as mgr:
                mgr.restore({"model": m2, "optim": entry2})
            losses = [step(m2, o2, i) for i in range(n, 2 * n)]
            rows.append({"mode": mode, "moment_bytes": moments, "checkpoint_bytes": total, "losses": losses})
        base = rows[0]
        ref_losses = base["losses"]
        exact_is_uninterrupted = ref_losses == uninterrupted
        for r in rows:
            r["final_loss"] = r["losses"][-1]
            r["mean_abs_loss_gap"] = sum(abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True)) / n
            r["max_rel_loss_gap"] = max(abs(a - b) / b for a, b in zip(r["losses"], ref_losses, strict=True))
            r["moment_bytes_saved"] = 1 - r["moment_bytes"] / base["moment_bytes"]
            r["checkpoint_bytes_saved"] = 1 - r["checkpoint_bytes"] / base["checkpoint_bytes"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"# Quantized optimizer state ({dt.date.today().isoformat()})",
        "",
        f"MLP with {params:,} parameters, AdamW, {n} steps, save, resume into a fresh model, {n} more "
        f"steps on the same batches; CPU, torch {torch.__version__}. Loss gaps are against the exact resume "
        f"({'which equals' if exact_is_uninterrupted else 'which DIFFERS from'} the uninterrupted run bit for bit).",
        "",
        "| mode | Adam state stored | saved | checkpoint | saved | final loss | mean abs loss gap | max rel loss gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['moment_bytes'] / 2**20:.2f} MiB | {100 * r['moment_bytes_saved']:.1f}% | "
            f"{r['checkpoint_bytes'] / 2**20:.2f} MiB | {100 * r['checkpoint_bytes_saved']:.1f}% | "
            f"{r['final_loss']:.6f} | {r['mean_abs_loss_gap']:.2e} | {100 * r['max_rel_loss_gap']:.3f}% |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        out = HERE / "results" / f"quantized-{dt.date.today().isoformat()}"
        out.with_suffix(".json").write_text(
            json.dumps(
                {"params": params, "steps": n, "exact_is_uninterrupted": exact_is_uninterrupted, "rows": rows}, indent=1
            )
            + "\n"
        )
        out.with_suffix(".md").write_text(text)
        print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
