"""Training-loop overhead of one checkpoint: shardkeeper (blocking / overlapped staging) vs DCP.

    python benchmarks/loop.py [--size-mib 192] [--steps 6] [--repeats 5] [--quick]

A small transformer under FSDP2 at world size 2 (gloo on CPU; NCCL with ``--device cuda``)
trains K steps, once without checkpointing and once per method with one save after step
``--save-after``; the methods alternate within each round (rotated each round) and every
figure is a median over rounds. Each timed loop ends when the save is committed, so a write
that outlasts the K steps is charged too. Methods:

- ``none``: no save (the baseline);
- ``sk_blocking``: ``CheckpointManager(staging="blocking")``, the default;
- ``sk_overlap``: ``staging="overlap"``: the copy runs during the next forward/backward and
  the next ``optimizer.step()`` waits for it (a step pre-hook);
- ``sk_buffered``: ``sk_blocking`` with ``storage_options={"direct_io": False}``: every byte
  through the page cache, as before docs/decisions.md D19 (O_DIRECT writes);
- ``dcp_reuse``: ``dcp.async_save`` with one reused ``DefaultStager`` (blocking staging);
- ``dcp_async_staging``: the same stager with ``use_async_staging=True``; the loop waits for
  ``staging_completion`` right before the next ``optimizer.step()`` (DCP's contract).
- ``sk_process`` / ``sk_process_overlap``: ``writer="process"`` with blocking / overlapped
  staging (a persist process writes and commits);
- ``dcp_process``: ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` with a reused
  blocking stager (DCP's writer daemon process).

DCP's async collectives run on their own gloo group (sharing the training group deadlocks
with FSDP's collectives); shardkeeper needs none. Reported per method: overhead = loop time
with the save minus without, in seconds, in units of a raw copy of the rank's state into
reused buffers, and per extra CPU second the save cost the process (all threads); also the
time ``save()`` blocked. Results: ``benchmarks/results/loop-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METHODS = (
    "none",
    "sk_blocking",
    "sk_overlap",
    "sk_buffered",
    "sk_process",
    "sk_process_overlap",
    "dcp_reuse",
    "dcp_async_staging",
    "dcp_process",
)


# -- the model ------------------------------------------------------------------------------
def make_model(dim: int, n_layers: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)
            self.heads = max(1, dim // 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.norm = nn.LayerNorm(dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                x = blk(x)
            return self.norm(x)

    return Transformer()


def dim_for(size_mib: float, n_layers: int, world: int) -> int:
    """Hidden size so that params + AdamW moments (12 bytes per parameter) per rank ~ size."""
    per_layer = size_mib * (1 << 20) * world / (12 * n_layers)  # ~12 d^2 parameters a layer
    return max(64, int(math.sqrt(per_layer / 12)) // 64 * 64)


# -- the worker (one per rank, under torchrun) ----------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _dcp_stager import ReusableStager
    from torch.distributed.checkpoint.staging import StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.fsdp import fully_shard

    from shardkeeper.core import CheckpointManager

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    dcp_group = dist.new_group(backend="gloo")
    work = Path(args.workdir)

    dim = dim_for(args.size_mib, args.layers, world)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = make_model(dim, args.layers)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(args.batch, args.seq, dim, generator=gen, device=dev)

    def step(wait_before_step: Any = None) -> None:
        model(x).pow(2).mean().backward()
        if wait_before_step is not None:
            wait_before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()  # optimizer state exists from here on
    local = []
    for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]:
        local.append(t.to_local() if hasattr(t, "to_local") else t)
    state_bytes = sum(t.numel() * t.element_size() for t in local)

    # The raw anchor: one copy of the rank's state into reused, preallocated host memory.
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in local]
    for b in bufs:
        b.zero_()
    raw: list[float] = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for b, t in zip(bufs, local):
            b.copy_(t, non_blocking=cuda)
        sync()
        raw.append(time.perf_counter() - t0)
    del bufs

    methods = tuple(m for m in METHODS if m in args.methods.split(","))
    builders = {
        "sk_blocking": lambda: CheckpointManager(work / "sk_blocking", staging="blocking"),
        "sk_overlap": lambda: CheckpointManager(work / "sk_overlap", staging="overlap"),
        "sk_buffered": lambda: CheckpointManager(
            work / "sk_buffered", staging="blocking", storage_options={"direct_io": False}
        ),
        "sk_process": lambda: CheckpointManager(work / "sk_process", staging="blocking", writer="process"),
        "sk_process_overlap": lambda: CheckpointManager(
            work / "sk_process_overlap", staging="overlap", writer="process"
        ),
    }
    mgrs = {m: build() for m, build in builders.items() if m in methods}
    opts = dict(use_pinned_memory=cuda, use_shared_memory=False, use_non_blocking_copy=cuda)
    stagers = {
        m: ReusableStager(StagingOptions(use_async_staging=m == "dcp_async_staging", **opts))
        for m in ("dcp_reuse", "dcp_async_staging", "dcp_process")
        if m in methods
    }
    counter = [0]

    def run(method: str) -> dict[str, Any]:
        """K steps, one save after step ``save_after``; ends when the save is committed."""
        counter[0] += 1
        n = counter[0]
        wait: Any = None
        pending: Any = None
        stall = 0.0
        dist.barrier()
        sync()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(wait)
            wait = None
            if i != args.save_after:
                continue
            # Every method alike (the baseline too): the queue of training kernels drains
            # first, so that what save() blocks on is the save, not the steps ahead of it.
            sync()
            if method == "none":
                continue
            s0 = time.perf_counter()
            if method.startswith("sk_"):
                pending = mgrs[method].save(n, {"model": model, "optim": opt})
            else:
                msd, osd = get_state_dict(model, opt)
                kind = AsyncCheckpointerType.PROCESS if method == "dcp_process" else AsyncCheckpointerType.THREAD
                resp = dcp.async_save(
                    {"model": msd, "optim": osd},
                    checkpoint_id=str(work / f"dcp-{n}"),
                    process_group=dcp_group,
                    async_stager=stagers[method],
                    async_checkpointer_type=kind,
                )
                if hasattr(resp, "staging_completion"):
                    wait = resp.staging_completion.result
                    pending = resp.upload_completion
                else:
                    pending = resp
            stall = time.perf_counter() - s0
        w0 = time.perf_counter()
        if pending is not None:
            (pending.wait if hasattr(pending, "wait") else pending.result)()
        tail = time.perf_counter() - w0  # the save outlasting the steps, as against slowing them
        sync()
        loop = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
        t = torch.tensor([loop, cpu, stall, tail], dtype=torch.float64)
        gathered = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=dcp_group)
        dist.barrier()
        if rank == 0:  # old checkpoints go outside the timed loop, for every method alike
            shutil.rmtree(work / f"dcp-{n}", ignore_errors=True)
            for mgr in mgrs.values():
                shutil.rmtree(mgr.step_url(n), ignore_errors=True)
        return {
            "loop_s": max(float(g[0]) for g in gathered),
            "cpu_s": sum(float(g[1]) for g in gathered) / world,
            "stall_s": max(float(g[2]) for g in gathered),
            "tail_s": max(float(g[3]) for g in gathered),
        }

    info = {
        "world_size": world,
        "device": args.device,
        "dim": dim,
        "layers": args.layers,
        "state_bytes_per_rank": state_bytes,
        "raw_copy_s": statistics.median(raw),
        "raw_copy_samples_s": raw,
        "steps": args.steps,
        "save_after": args.save_after,
        "batch": args.batch,
        "seq": args.seq,
        "torch": torch.__version__,
    }
    samples: list[dict[str, Any]] = []
    for r in range(-1, args.repeats):  # round -1 warms every method up (buffers, files)
        k = max(r, 0) % len(methods)
        for m in methods[k:] + methods[:k]:
            res = run(m)
            if r >= 0:
                samples.append({"round": r, "method": m, **res})
        info["dcp_stager_refills"] = {m: st.refills for m, st in stagers.items()}  # see _dcp_stager.py
        if rank == 0 and r >= 0:  # after every round: a run cut short keeps its finished rounds
            (work / "loop-raw.json").write_text(json.dumps({"info": info, "samples": samples}))
    for mgr in mgrs.values():
        mgr.close()
    for st in stagers.values():
        st.close_now()
    dist.barrier()
    dist.destroy_process_group()


# -- the parent: launch, summarize, write results -------------------------------------------
def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    info, samples = raw["info"], raw["samples"]
    by = {m: [s for s in samples if s["method"] == m] for m in METHODS if any(s["method"] == m for s in samples)}
    med = {
        m: {k: statistics.median(s.get(k, 0.0) for s in v) for k in ("loop_s", "cpu_s", "stall_s", "tail_s")}
        for m, v in by.items()
        if v
    }
    base = med["none"]
    rows = {}
    for m, v in med.items():
        over = v["loop_s"] - base["loop_s"]
        # Paired per round (same round, neighbouring runs) as a robustness check on the median.
        paired = statistics.median(
            s["loop_s"] - next(b["loop_s"] for b in by["none"] if b["round"] == s["round"]) for s in by[m]
        )
        extra_cpu = v["cpu_s"] - base["cpu_s"]
        rows[m] = {
            **v,
            "overhead_s": over,
            "overhead_paired_s": paired,
            "overhead_per_raw_copy": over / info["raw_copy_s"] if info["raw_copy_s"] else None,
            "extra_cpu_s": extra_cpu,
            "overhead_per_extra_cpu_s": over / extra_cpu if extra_cpu > 0 else None,
        }
    dcp_min = min((rows[m]["overhead_s"] for m in rows if m.startswith("dcp")), default=0.0)
    for m in rows:
        if m.startswith("sk_"):
            rows[m]["overhead_per_best_dcp"] = rows[m]["overhead_s"] / dcp_min if dcp_min > 0 else None
    return {
        "info": info,
        "methods": rows,
        "samples": samples,
        "target": "CPU: sk overhead <= 0.5x the smallest DCP variant's; GPU: <= 0.25x a raw D2H copy",
    }


def markdown(res: dict[str, Any], command: str) -> str:
    i = res["info"]
    lines = [
        f"# Training-loop overhead of one save ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`: FSDP2, world size {i['world_size']} on {i['device']}, a {i['layers']}-block "
        f"transformer (d={i['dim']}), {i['state_bytes_per_rank'] / 2**20:.0f} MiB of parameters + AdamW "
        f"state per rank, {i['steps']} steps, one save after step {i['save_after']}; medians of "
        f"{len({s['round'] for s in res['samples']})} rounds. Raw copy of the rank's state into reused "
        f"buffers: {i['raw_copy_s'] * 1e3:.1f} ms.",
        "",
        "| method | K-step loop (s) | overhead (s) | paired (s) | / raw copy | / best DCP | save() blocked (s) "
        "| waited after the steps (s) | extra CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in res["methods"].items():

        def f(v: Any, fmt: str = "{:.3f}") -> str:
            return "" if v is None else fmt.format(v)

        lines.append(
            f"| {m} | {r['loop_s']:.3f} | {f(r['overhead_s'])} | {f(r['overhead_paired_s'])} | "
            f"{f(r['overhead_per_raw_copy'], '{:.1f}x')} | {f(r.get('overhead_per_best_dcp'), '{:.2f}')} | "
            f"{r['stall_s']:.3f} | {r['tail_s']:.3f} | {f(r['extra_cpu_s'])} |"
        )
    lines += [
        "",
        "Overhead = loop with one save (ended when the save is committed) - loop without; "
        "waited after the steps = how long the loop waited for the save after its last step (the part of "
        "the overhead that is the save outlasting the steps; the rest is what the steps lost beside it); "
        "extra CPU = CPU seconds of the process (all threads) with the save - without, per rank.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=192.0, help="parameters + AdamW state per rank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-after", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)} ('none' is kept)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 16 MiB, 3 steps, 1 round (results: *-quick.json)"
    )
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timeout-s", type=float, default=540.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.steps, args.repeats = 16.0, 3, 1
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"unknown --methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    args.methods = ",".join(dict.fromkeys(["none", *args.methods.split(",")]))
    if args.worker:
        worker(args)
        return 0
    command = "python benchmarks/loop.py " + " ".join(argv if argv is not None else sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="sk-loop-", dir=args.workdir))
    try:
        fwd = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("quick", "worker", "workdir", "results_dir", "timeout_s", "nproc")
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            __file__,
            "--worker",
            f"--workdir={work}",
            *fwd,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        from shardkeeper.core.testing.procs import kill_tree

        child = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            child.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"loop benchmark: no end within {args.timeout_s:.0f} s; stopped", file=sys.stderr)
        finally:
            if child.poll() is None:
                kill_tree(child)
        child.wait()
        raw_file = work / "loop-raw.json"
        if child.returncode != 0:
            print(f"loop benchmark failed (exit {child.returncode})", file=sys.stderr)
            if not raw_file.is_file():
                return child.returncode or 1
            print("summarizing the rounds that finished", file=sys.stderr)
        res = summarize(json.loads(raw_file.read_text()))
        res["partial"] = child.returncode != 0
        res["info"]["command"] = command
        res["info"]["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
        md = markdown(res, command)
        print(md)
        out = Path(args.results_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"loop-{time.strftime('%Y-%m-%d')}" + ("" if args.device == "cpu" else f"-{args.device}")
        stem += "-quick" if args.quick else ""
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text(md)
        print(f"wrote {out / stem}.json and .md")
        return 0 if not res["partial"] else (child.returncode or 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
