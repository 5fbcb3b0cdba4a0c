"""The CUDA paths, proven in one run on one GPU: correctness, stall and loop overhead vs DCP, host memory.

    PYTHONPATH=packages/core/src:. python benchmarks/gpu.py              # on a GPU machine, < 9 min
    python benchmarks/gpu.py --dry-run --results-dir /tmp/r               # anywhere: everything up to CUDA

Runs from the source tree (no install step) on the torch it finds, CUDA builds from 2.9 on
(DCP's ``DefaultStager`` and its ``StagingOptions`` fields), with or without orjson. It checks ``torch.cuda.is_available()`` first and says what is
missing otherwise. Then, in this order, each part under its own time limit, all within
``--budget-s`` (a part that fails or runs out of time is recorded and the next one runs; the
results files are rewritten after every part, so a run cut short keeps what it measured):

1. **Correctness on CUDA**: ``pytest -m cuda tests/cuda`` (save and restore of CUDA
   parameters and AdamW state at world size 1 and 2, NCCL at world size 1, the overlapped
   staging race, restores into CUDA targets; see tests/cuda), every test's outcome recorded.
2. **Stall and loop overhead vs DCP** (``benchmarks/loop.py --device cuda --nproc 1``, per
   ``--sizes-gib``, default 1 and 4 GiB of weights + AdamW state): the time ``save()``
   blocks, against a raw device-to-host copy of the same tensors into reused pinned buffers,
   and the overhead of one save on a K-step loop, (K steps with a save) - (K steps without),
   in units of that copy, for shardkeeper's blocking and overlapped staging and DCP
   ``async_save`` with a pinned ``DefaultStager`` (blocking and async staging). Targets:
   stall <= 1.1x the raw copy; with overlapped staging, loop overhead <= 0.25x the raw copy
   and below every DCP variant (blocking staging copies on the compute stream: reported).
3. **Host memory** (``benchmarks/gpu_memory.py``): RSS and pinned bytes after each of N saves
   do not grow (target: pinned-allocator growth 0, RSS growth < 1% of the state).
4. **Logical digests on the device** (``benchmarks/gpu_logical.py``, ``--logical-mib``,
   default 1 GiB): the partial sums computed on the GPU by torch ops, in seconds per GiB,
   against a raw device-to-host copy of the same bytes and the numpy path over the host copy
   (what a save computes from its staged bytes), for a whole tensor, a column shard, rows that
   are not whole blocks and 10,000 small tensors; the peak extra device memory; and whether
   the device's sums equal the numpy path's (judged; the times are reported).

``--parts`` names the parts to run (``tests,loop,memory,logical`` by default): a second call on a
short lease redoes only what failed. Writes ``benchmarks/results/gpu-<date>.json`` and ``.md``
(``--results-dir``).
``--dry-run`` (no GPU needed) runs the same script on CPU: the environment report, the
collection of the CUDA tests, the loop, memory and logical parts at a tiny size on CPU and the writer
(results ``gpu-<date>-dry-run.*``); its figures say nothing about CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "packages" / "core" / "src"))

from gpu_report import markdown, targets  # noqa: E402

from shardkeeper.core.testing.procs import kill_tree  # noqa: E402

#: The packages' sources, first on the children's path: the script runs from the source tree.
SOURCES = [
    ROOT / "packages" / name / "src" for name in ("core", "accelerate_plugin", "lightning_plugin", "deepspeed_plugin")
]


def environment() -> dict[str, Any]:
    """What this machine has: torch and its CUDA build, the GPU, the optional packages."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    env["cpus"] = os.cpu_count()
    try:
        import torch
    except ImportError as e:
        env["missing"] = f"torch is not installed ({e}); install a CUDA build of torch"
        return env
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["cuda_available"] = bool(torch.cuda.is_available())
    if env["cuda_available"]:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    elif torch.version.cuda is None:
        env["missing"] = (
            f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): run on a machine with a CUDA "
            "build of torch, or pass --dry-run"
        )
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["missing"] = (
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but torch.cuda.is_available() is "
            f"False: no GPU or driver is visible (CUDA_VISIBLE_DEVICES={visible!r}; check nvidia-smi), or pass --dry-run"
        )
    from importlib import metadata

    env["packages"] = {}
    for name in (
        "numpy",
        "xxhash",
        "fsspec",
        "orjson",
        "safetensors",
        "pytest",
        "pytest-timeout",
        "tqdm",
        "accelerate",
    ):
        try:
            env["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env["packages"][name] = None
    shm = Path("/dev/shm")
    if shm.is_dir():
        usage = shutil.disk_usage(shm)
        env["dev_shm"] = {"total_bytes": usage.total, "free_bytes": usage.free}
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,compute_mode,memory.total"
        try:
            out = subprocess.run(
                ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            env["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            env["nvidia_smi"] = f"failed: {e}"
    return env


def _child_env() -> dict[str, str]:
    paths = [*map(str, SOURCES), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own session; on timeout kill its whole process group."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env or _child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 1.0))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # every process under it, in whatever session (torchrun starts its own)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "(no output: a process outside the tree still holds the pipe)"
        rc = None
    return {
        "cmd": " ".join(cmd),
        "rc": rc,
        "timed_out": rc is None,
        "seconds": time.perf_counter() - t0,
        "tail": out[-6000:],
    }


def _pytest(args: argparse.Namespace, work: Path, suite: str, timeout_s: float) -> dict[str, Any]:
    """One pytest run of the CUDA-marked tests of ``suite``, each test's outcome recorded."""
    junit = work / f"junit-{Path(suite).stem}.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", suite, "-q", "-rA", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}"]
    if args.dry_run:
        cmd.append("--collect-only")
    res = _run(cmd, timeout_s)
    tests: list[dict[str, Any]] = []
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (el.get("message") or el.text or "")[:2000]
                    break
            name = f"{case.get('classname')}::{case.get('name')}"
            tests.append(
                {"name": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message}
            )
    if args.dry_run:  # --collect-only writes no test cases: take the names from the listing
        tests = [{"name": ln.strip(), "outcome": "collected"} for ln in res["tail"].splitlines() if "::" in ln]
    elif not tests:  # killed before pytest wrote its junit: the -rA summary lines that made it out
        for ln in res["tail"].splitlines():
            word, _, rest = ln.partition(" ")
            if word in ("PASSED", "FAILED", "ERROR", "SKIPPED") and "::" in rest:
                name, _, message = rest.partition(" - ")
                tests.append({"name": name.strip(), "outcome": word.lower(), "message": message})
        if res["timed_out"]:
            tests.append(
                {"name": f"{suite} (the rest)", "outcome": "error", "message": f"no end within {timeout_s:.0f} s"}
            )
    res["tests"] = tests
    return res


def part_tests(args: argparse.Namespace, work: Path, budget: Budget) -> dict[str, Any]:
    """Part 1: the CUDA-marked tests (collected only, in a dry run); Accelerate's FSDP plugin
    in its own run, so that a slow one cannot take the core's outcomes with it."""
    runs = [_pytest(args, work, "tests/cuda", budget.limit(args.tests_timeout_s))]
    if importlib.util.find_spec("accelerate") is not None:  # Accelerate's FSDP plugin needs CUDA
        acc = "tests/accelerate/test_fsdp_plugin_gpu.py"
        runs.append(_pytest(args, work, acc, budget.limit(args.accelerate_timeout_s)))
    return {
        "runs": [{k: v for k, v in r.items() if k != "tests"} for r in runs],
        "rc": max((r["rc"] if r["rc"] is not None else 1) for r in runs),
        "tests": [t for r in runs for t in r["tests"]],
    }


class Budget:
    """The run's time: each part gets its own cap, or what is left of ``--budget-s``."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def limit(self, cap_s: float) -> float:
        return max(1.0, min(cap_s, self.end - time.monotonic()))


def part_loop(args: argparse.Namespace, work: Path, size_mib: float, timeout_s: float) -> dict[str, Any]:
    """Part 2, one size: benchmarks/loop.py on one rank, its results read back (the rounds that
    finished, if it ran out of time)."""
    out = work / f"loop-{size_mib:g}"
    device = "cpu" if args.dry_run else "cuda"
    repeats = args.repeats
    if not args.workdir.startswith("/dev/shm") and size_mib >= 4096:
        repeats = 1  # on disk, 4 GiB checkpoints take seconds each: one round, not the budget
    cmd = [sys.executable, str(HERE / "loop.py"), f"--device={device}", "--nproc=1", f"--size-mib={size_mib:g}"]
    cmd += [f"--steps={args.steps}", "--save-after=1", f"--batch={args.batch}", f"--seq={args.seq}"]
    methods = "sk_blocking,sk_overlap,sk_process,sk_process_overlap,dcp_reuse,dcp_async_staging,dcp_process"
    cmd += [f"--repeats={repeats}", f"--methods={methods}"]
    cmd += [f"--results-dir={out}", f"--workdir={args.workdir}", f"--timeout-s={max(timeout_s - 15, 5):.0f}"]
    res = _run(cmd, timeout_s)
    found = sorted(out.glob("loop-*.json"))
    if found:
        data = json.loads(found[0].read_text())
        res["info"], res["methods"], res["partial"] = data["info"], data["methods"], data.get("partial", False)
    return res


def part_memory(args: argparse.Namespace, work: Path, timeout_s: float) -> dict[str, Any]:
    """Part 3: host memory across repeated saves."""
    out = work / "memory.json"
    device = "cpu" if args.dry_run else "cuda"
    cmd = [sys.executable, str(HERE / "gpu_memory.py"), f"--out={out}", f"--device={device}"]
    cmd += [f"--size-mib={args.memory_mib:g}", f"--saves={args.saves}", f"--workdir={args.workdir}"]
    res = _run(cmd, timeout_s)
    if out.is_file():
        res["result"] = json.loads(out.read_text())
    return res


def part_logical(args: argparse.Namespace, work: Path, timeout_s: float) -> dict[str, Any]:
    """Part 4: the logical digests' partial sums on the device against a raw copy."""
    out = work / "logical.json"
    device = "cpu" if args.dry_run else "cuda"
    cmd = [sys.executable, str(HERE / "gpu_logical.py"), f"--out={out}", f"--device={device}"]
    cmd += [f"--mib={args.logical_mib:g}", f"--repeats={args.repeats}"]
    res = _run(cmd, timeout_s)
    if out.is_file():
        res["result"] = json.loads(out.read_text())
    return res


PARTS = ("tests", "loop", "memory", "logical")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: everything up to the first CUDA call, on CPU")
    ap.add_argument("--sizes-gib", default="1,4", help="part 2's state sizes (weights + AdamW), GiB")
    ap.add_argument("--steps", type=int, default=24, help="part 2: K, the steps of one timed loop")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-mib", type=float, default=512.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--logical-mib", type=float, default=1024.0, help="part 4's shard size, MiB")
    ap.add_argument("--budget-s", type=float, default=520.0, help="the whole run's time, the parts' caps within it")
    ap.add_argument("--tests-timeout-s", type=float, default=90.0)
    ap.add_argument("--accelerate-timeout-s", type=float, default=75.0)
    ap.add_argument("--loop-timeout-s", type=float, default=75.0, help="per size; the largest gets twice this")
    ap.add_argument("--memory-timeout-s", type=float, default=45.0)
    ap.add_argument("--logical-timeout-s", type=float, default=60.0)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"the parts to run, of {','.join(PARTS)}")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--workdir", default=None, help="checkpoints go here (default: /dev/shm when it has room)")
    args = ap.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        ap.error(f"--parts {','.join(args.parts)!r}: name one or more of {', '.join(PARTS)} (unknown: {unknown})")
    if args.dry_run:
        args.sizes_gib, args.steps, args.batch, args.seq, args.repeats = "0.015625", 3, 2, 16, 1
        args.memory_mib, args.saves, args.logical_mib = 8.0, 3, 2.0
    return args


def _workdir(args: argparse.Namespace) -> str:
    if args.workdir:
        return str(args.workdir)
    need = 3 * max(float(s) for s in args.sizes_gib.split(",")) * (1 << 30)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return str(shm)
    return tempfile.gettempdir()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    env = environment()
    print(json.dumps(env, indent=1), flush=True)
    if "missing" in env and not (args.dry_run and "torch" in env):
        print(f"benchmarks/gpu.py: {env['missing']}", file=sys.stderr)
        return 2
    args.workdir = _workdir(args)
    work = Path(tempfile.mkdtemp(prefix="sk-gpu-", dir=args.workdir))
    res: dict[str, Any] = {"started": started, "dry_run": args.dry_run, "environment": env, "workdir": args.workdir}
    res["command"] = "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.perf_counter()
    budget = Budget(args.budget_s)
    stem = Path(args.results_dir) / (f"gpu-{time.strftime('%Y-%m-%d')}" + ("-dry-run" if args.dry_run else ""))

    def write() -> None:
        res["seconds"] = time.perf_counter() - t0
        res["targets"] = targets(res)
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
        stem.with_suffix(".md").write_text(markdown(res))

    try:
        if "tests" in args.parts:
            print("== part 1: CUDA tests", flush=True)
            res["tests"] = part_tests(args, work, budget)
            write()
        res["loop"] = {}
        sizes = [float(s) for s in args.sizes_gib.split(",")] if "loop" in args.parts else []
        for i, gib in enumerate(sizes):
            print(f"== part 2: stall and loop overhead, {gib:g} GiB", flush=True)
            cap = args.loop_timeout_s * (2 if i == len(sizes) - 1 and len(sizes) > 1 else 1)
            res["loop"][f"{gib:g}"] = part_loop(args, work, gib * 1024, budget.limit(cap))
            write()
        if "memory" in args.parts:
            print("== part 3: host memory across saves", flush=True)
            res["memory"] = part_memory(args, work, budget.limit(args.memory_timeout_s))
            write()
        if "logical" in args.parts:
            print("== part 4: logical digests on the device", flush=True)
            res["logical"] = part_logical(args, work, budget.limit(args.logical_timeout_s))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        write()
    print(markdown(res))
    print(f"wrote {stem}.json and .md")
    # Non-zero when a test failed or a part did not run; a missed speed target is a figure, not an error.
    return 1 if any(r["pass"] is False and (r["part"] == "tests" or r["what"] == "ran") for r in res["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
