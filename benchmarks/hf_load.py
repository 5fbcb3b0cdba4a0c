"""Starting from a Hugging Face folder on every rank: ``from_pretrained`` against ``load_hf``.

    python benchmarks/hf_load.py [--ranks 2] [--layers 4] [--quick]

A Llama from a config (vocab 16000, hidden 1024, MLP 2816, ``--layers`` layers, untied; float32:
about 330 MB at 4 layers) is saved once with ``save_pretrained`` in 100 MB shards. Then, one
gloo launch of ``--ranks`` ranks per method, the folder evicted from the page cache before
each (``POSIX_FADV_DONTNEED``), every rank:

- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(folder)``, the whole model;
- ``load_hf fsdp2``: the model built on the meta device, each layer and the root
  ``fully_shard``-ed, ``to_empty(device="cpu")`` (this rank's shards, untouched), then
  ``load_hf(folder, model)``;
- ``load_hf replicated``: the whole model built the same way without ``fully_shard``, then
  ``load_hf`` (each range read by one rank and sent to the others: the Trainer's and DDP's path).

Per rank: the seconds from a barrier to the model loaded and its pages touched (construction
included: ``from_pretrained`` maps the files, read as their pages are first touched); the bytes
read (``load_hf``: counted by the storage it reads through, index and headers included;
``from_pretrained`` maps the files and reads every tensor: the bytes of its process's
``read(2)`` calls, ``rchar``, and the folder's tensors); the peak RSS above the process's RSS
just before (VmHWM reset there), against this rank's share of the model (its parameters'
local bytes). Results: ``benchmarks/results/hf-load-<date>.{json,md}`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _proc  # noqa: E402

METHODS = ("from_pretrained", "load_hf fsdp2", "load_hf replicated")
TARGET = 1.1


def make_folder(folder: Path, layers: int) -> int:
    """The Llama saved in ``folder``; the bytes of its tensors."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100MB")
    return int(json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"])


# -- one rank of one method (under torchrun) --------------------------------------------------------
def worker(method: str, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkeeper.core import load_hf
    from shardkeeper.core.storage import LocalStorage

    class Counting(LocalStorage):
        """Counts the bytes read through it (``read_range`` comes through ``read_into``)."""

        read = 0

        def read_bytes(self, path: str) -> bytes:
            data = super().read_bytes(path)
            self.read += len(data)
            return data

        def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
            super().read_into(path, offset, buffer)
            self.read += len(buffer)

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # imports the model's modules before the baseline, for every method
        fully_shard(AutoModelForCausalLM.from_config(config), mesh=init_device_mesh("cpu", (world,)))
    _proc.malloc_trim()
    base, rchar0 = _proc.rss_bytes(), _proc.rchar()
    hwm_reset = _proc.reset_hwm()
    dist.barrier()
    t0 = time.perf_counter()
    read: int | None = None
    build_peak = 0
    if method == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        built, before_load = t0, base
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if method == "load_hf fsdp2":
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        built = time.perf_counter()
        build_peak = _proc.hwm_bytes() - base
        _proc.malloc_trim()
        before_load = _proc.rss_bytes()
        _proc.reset_hwm()
        storage = Counting(folder)
        load_hf(storage, model)
        read = storage.read
    with torch.no_grad():  # every page of the parameters touched (a mapped file's too), as training does
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()
    seconds = time.perf_counter() - t0
    peak = _proc.hwm_bytes() - before_load
    dist.barrier()
    share = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        share += local.numel() * local.element_size()
    row = {
        "method": method,
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "build_s": built - t0,
        "bytes_read": read,
        "rchar": _proc.rchar() - rchar0,
        "share": share,
        "peak_rss_above_start": peak,
        "rss_at_start": base,
        "rss_before_load": before_load,
        "build_peak_rss_above_start": None if method == "from_pretrained" else build_peak,
        "hwm_reset": hwm_reset,
    }
    (out / f"{method.replace(' ', '_')}-r{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------
def launch(method: str, folder: Path, out: Path, ranks: int) -> list[dict[str, Any]]:
    _proc.evict(folder)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += [__file__, "--worker", method, str(folder), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{method}: the launch failed\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    return [json.loads((out / f"{method.replace(' ', '_')}-r{r}.json").read_text()) for r in range(ranks)]


def report(rows: list[dict[str, Any]], total: int, args: argparse.Namespace, info: dict[str, Any]) -> str:
    mib = 2**20
    load = f"load average {info['load_avg_at_start'][0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    lines = [
        f"# Starting from a Hugging Face folder: from_pretrained against load_hf ({dt.date.today().isoformat()})",
        "",
        f"`python benchmarks/hf_load.py --ranks {args.ranks} --layers {args.layers}`: a Llama of "
        f"{total / mib:.0f} MiB (float32, {args.layers} layers, vocab 16000, hidden 1024, untied) saved by "
        f"`save_pretrained` in 100 MB shards, loaded on {args.ranks} gloo ranks, one launch per method, the "
        f"folder evicted from the page cache before each; {info['cores']} CPUs ({info['cpu_model']}), torch "
        f"{info['torch']}, shardkeeper {info['shardkeeper_git']}; {load}. The machine was shared with other "
        f"test runs at the time (2 cores): the seconds carry their load, the bytes and memory do not.",
        "",
        "| method | rank | seconds | of which building | bytes read | read / share | share | peak RSS of the load | "
        "peak / share | peak RSS of building |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        read = r["bytes_read"] if r["bytes_read"] is not None else total
        note = "" if r["bytes_read"] is not None else " (every tensor)"
        b = r["build_peak_rss_above_start"]
        build = "(inside)" if b is None else f"{b / mib:.1f} MiB"
        lines.append(
            f"| {r['method']} | {r['rank']} | {r['seconds']:.2f} | {r['build_s']:.2f} | {read / mib:.1f} MiB{note} | "
            f"{read / r['share']:.3f} | {r['share'] / mib:.1f} MiB | {r['peak_rss_above_start'] / mib:.1f} MiB | "
            f"{r['peak_rss_above_start'] / r['share']:.3f} | {build} |"
        )
    by = {m: [r for r in rows if r["method"] == m] for m in METHODS}
    lines += ["", "Over the ranks:", "", "| method | slowest rank (s) | bytes read, all ranks | / the folder |"]
    lines += ["|---|---:|---:|---:|"]
    for m, rs in by.items():
        read = sum(r["bytes_read"] if r["bytes_read"] is not None else total for r in rs)
        lines.append(f"| {m} | {max(r['seconds'] for r in rs):.2f} | {read / mib:.1f} MiB | {read / total:.3f} |")
    verdicts = []
    for m in ("load_hf fsdp2", "load_hf replicated"):
        worst = max(r["peak_rss_above_start"] / r["share"] for r in by[m])
        verdicts.append(f"{m.removeprefix('load_hf ')} {'met' if worst <= TARGET else 'MISSED'} (worst {worst:.3f})")
    lines += [
        "",
        f"Target (load_hf): the load's peak RSS <= {TARGET} x the rank's share on every rank: {', '.join(verdicts)}.",
        "",
        "seconds: from a barrier to the model loaded on that rank and every parameter's pages touched (a sum of "
        "each: from_pretrained maps the files and reads them as their pages are first touched), the model's "
        "construction included (`from_config` "
        'on the meta device, `fully_shard`, `to_empty`: "of which building"; `from_pretrained` builds inside). '
        "bytes read: load_hf's counted by the storage it reads through (index and headers included); "
        "from_pretrained maps the files and touches every tensor, so it is the folder's tensors (its `read(2)` "
        "bytes, rchar, are in the JSON). share: this rank's parameters' local bytes. peak RSS of the load: VmHWM "
        "reset just before the load (from_pretrained: its whole call; load_hf: the call alone, after building), "
        "minus the RSS then, with every parameter's pages touched (so that a mapped file's pages count as "
        "they do once training reads them); the model's own pages are part of it "
        "(to_empty leaves them untouched until the load writes them). peak RSS of building: the same over "
        "`from_config`, `fully_shard` and `to_empty`. The imports (transformers' model code, FSDP2) are done "
        "before the baseline, by building the model once on the meta device. Built on the meta "
        "device, a model's non-persistent buffers (Llama's rotary `inv_freq`) are left uninitialized by "
        "`to_empty`: a run built that way sets them itself; the tests build on the CPU instead.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=3, metavar=("METHOD", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="do not write results files")
    args = ap.parse_args()
    if args.worker:
        method, folder, out = args.worker
        worker(method, Path(folder), Path(out))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="hf-load-", dir=args.workdir))
    try:
        info = _proc.machine_info(str(work), HERE.parent)
        total = make_folder(work / "folder", args.layers)
        (work / "out").mkdir()
        rows = [row for m in METHODS for row in launch(m, work / "folder", work / "out", args.ranks)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(rows, total, args, info)
    print(text)
    if not args.quick:
        out = HERE / "results" / f"hf-load-{dt.date.today().isoformat()}"
        out.with_suffix(".json").write_text(
            json.dumps({"machine": info, "folder_bytes": total, "rows": rows}, indent=1) + "\n"
        )
        out.with_suffix(".md").write_text(text)
        print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
