"""How much of a Python-heavy thread's speed one async save beside it leaves, per writer.

    python benchmarks/gil.py [--size-mib 512] [--repeats 5] [--writers sk_thread,sk_process] [--quick]

One process (in a 1-rank gloo group on a ``FileStore``: DCP's ``async_save`` needs a group).
A loop thread runs tiny torch ops on 16-element CPU tensors all the time, as a thread that
launches kernels does, and counts its iterations. The state: 8 float32 tensors of
``--size-mib`` MiB in all. Each writer saves once to warm up (buffers, processes, plans);
then, in rounds with the writers' order rotated each round, for each writer: a window with
no save (as long as that writer's previous save, at least 1 s), then one async save, timed
from the ``save()`` call until the save is committed. Kept = the loop's iterations/s during
the save / its iterations/s in the window just before; medians and min-max over rounds, with
the save's duration, how long the call blocked, the machine's busy cores in each window (all
processes), and where the loop thread's time went (``/proc/self/task/<tid>/schedstat``: on a
CPU, runnable but waiting for one, or neither) with how often it went to sleep (its voluntary
context switches, ``/proc/self/task/<tid>/status``: every wait for the GIL is one). "Neither"
with no sleeps is not the GIL: it is time this kernel does not account to the thread at all
(on a virtual machine, time its virtual CPU did not run). Writers:

- ``sk_thread``: ``CheckpointManager(writer="thread")``: staging copy in the call, then
  digests, writes and the commit on a thread of this process;
- ``sk_process``: ``writer="process"``: the staging copy (into shared memory) in this
  process, the rest in the rank's persist process;
- ``dcp_thread``: ``dcp.async_save`` in thread mode, one reused ``DefaultStager``;
- ``dcp_process``: ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``, one reused
  ``DefaultStager`` staging into shared memory; DCP's daemon process writes.

Target: ``sk_process`` keeps >= 0.95. ``--sk-options '{"io_threads": 1}'`` passes options to
both shardkeeper managers (a trial of a setting). The work dir (under ``--workdir``, default
the system temp dir) is made fresh and removed after. Results:
``benchmarks/results/gil-<date>[-<tag>].json`` and ``.md`` (``--tag``; ``quick`` with
``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WRITERS = ("sk_thread", "sk_process", "dcp_thread", "dcp_process")
TARGET = 0.95
N_TENSORS = 8
MIN_WINDOW_S = 1.0
BUSY_QUEUED = 0.1  # the loop thread waiting for a CPU this much with no save: a busy machine


def _busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (every process)."""
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


# (time, loop iterations, machine busy s, loop thread's s on a CPU, its s runnable waiting for one,
#  its voluntary context switches: the times it went to sleep)
Mark = tuple[float, int, float, float, float, int]


class Spinner:
    """The Python-heavy loop: tiny torch ops on 16-element tensors, counted, on a thread."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._tid = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spinner", daemon=True)

    def _run(self) -> None:
        import torch

        self._tid = threading.get_native_id()
        self._started.set()
        x, w = torch.zeros(16), torch.ones(16)
        while not self._stop:
            x.add_(w)
            y = x * 2
            y.sub_(w)
            x.copy_(y).mul_(0.25)
            self.count += 1

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        self._stop = True
        self._thread.join()

    def mark(self) -> Mark:
        with open(f"/proc/self/task/{self._tid}/schedstat") as f:
            run_ns, queued_ns = map(int, f.read().split()[:2])
        with open(f"/proc/self/task/{self._tid}/status") as f:
            sleeps = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return time.perf_counter(), self.count, _busy_s(), run_ns / 1e9, queued_ns / 1e9, sleeps


def _window(a: Mark, b: Mark) -> dict[str, float]:
    wall = b[0] - a[0]
    on_cpu, queued = (b[3] - a[3]) / wall, (b[4] - a[4]) / wall
    return {
        "wall_s": wall,
        "iters_per_s": (b[1] - a[1]) / wall,
        "busy_cores": (b[2] - a[2]) / wall,
        "loop_on_cpu": on_cpu,
        "loop_cpu_queued": queued,
        "loop_off_cpu": max(0.0, 1.0 - on_cpu - queued),
        "loop_sleeps_per_s": (b[5] - a[5]) / wall,
    }


# -- the worker: one process, every writer -------------------------------------------------
def _writers(args: argparse.Namespace, work: Path, state: dict[str, Any], group: Any) -> dict[str, Any]:
    """Per writer: ``(save(step) -> wait(), delete(step), close())``."""
    import torch.distributed.checkpoint as dcp
    from _dcp_stager import ReusableStager
    from torch.distributed.checkpoint.staging import StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from shardkeeper.core import CheckpointManager

    out: dict[str, Any] = {}
    for name in args.writers.split(","):
        if name.startswith("sk_"):
            mgr = CheckpointManager(work / name, writer=name.removeprefix("sk_"), **json.loads(args.sk_options))

            def sk_save(step: int, mgr: Any = mgr) -> Any:
                return mgr.save(step, state).wait

            def sk_delete(step: int, mgr: Any = mgr) -> None:
                mgr.delete(step)

            out[name] = (sk_save, sk_delete, mgr.close)
        else:
            process = name == "dcp_process"
            opts = dict(use_pinned_memory=False, use_async_staging=False, use_non_blocking_copy=False)
            stager = ReusableStager(StagingOptions(use_shared_memory=process, **opts))
            kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD

            def dcp_save(step: int, name: str = name, kind: Any = kind, stager: Any = stager) -> Any:
                fut = dcp.async_save(
                    state,
                    checkpoint_id=str(work / f"{name}-{step}"),
                    process_group=group,
                    async_checkpointer_type=kind,
                    async_stager=stager,
                )
                assert isinstance(fut, Future)  # staged in the call: no staging future to return
                return lambda: fut.result(timeout=args.save_timeout_s)

            def dcp_delete(step: int, name: str = name) -> None:
                shutil.rmtree(work / f"{name}-{step}", ignore_errors=True)

            out[name] = (dcp_save, dcp_delete, stager.close_now)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    work = Path(args.workdir)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's process mode: its daemon's store
    dist.init_process_group("gloo", store=dist.FileStore(str(work / "pg-store"), 1), rank=0, world_size=1)
    numel = int(args.size_mib * (1 << 20)) // (4 * N_TENSORS)
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(numel, generator=gen) for i in range(N_TENSORS)}
    info: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in state.values())}
    info.update(tensors=N_TENSORS, repeats=args.repeats, torch=torch.__version__, loadavg_before=os.getloadavg())
    info["sk_options"] = args.sk_options
    errors: dict[str, str] = {}
    samples: list[dict[str, Any]] = []
    raw_file = work / "gil-raw.json"
    spinner = Spinner()
    spinner.start()
    writers = _writers(args, work, state, dist.group.WORLD)
    last_s: dict[str, float] = {}
    step = [0]

    def one(name: str) -> dict[str, Any]:
        save, delete, _ = writers[name]
        step[0] += 1
        time.sleep(0.2)  # the previous save's deletion settles
        a = spinner.mark()
        time.sleep(max(MIN_WINDOW_S, last_s.get(name, MIN_WINDOW_S)))
        b = spinner.mark()
        wait = save(step[0])
        c = time.perf_counter()
        wait()
        d = spinner.mark()
        delete(step[0])
        base, during = _window(a, b), _window(b, d)
        last_s[name] = during["wall_s"]
        return {
            "base": base,
            "during": during,
            "kept": during["iters_per_s"] / base["iters_per_s"],
            "save_s": during["wall_s"],
            "call_s": c - b[0],
        }

    def attempt(name: str, rnd: int) -> None:
        try:
            res = one(name)
        except Exception as e:  # a writer that fails is recorded and left out of later rounds
            errors[name] = f"{'warm-up' if rnd < 0 else f'round {rnd}'}: {type(e).__name__}: {e}"
            traceback.print_exc()
            return
        if rnd >= 0:
            samples.append({"round": rnd, "writer": name, **res})

    for r in range(-1, args.repeats):  # round -1 warms every writer up
        names = [n for n in writers if n not in errors]
        k = max(r, 0) % max(len(names), 1)
        for name in names[k:] + names[:k]:
            attempt(name, r)
        if r >= 0:  # after every round: a run cut short keeps its finished rounds
            raw_file.write_text(json.dumps({"info": info, "errors": errors, "samples": samples}))
    spinner.stop()
    for _, _, close in writers.values():
        close()
    info["loadavg_after"] = os.getloadavg()
    raw_file.write_text(json.dumps({"info": info, "errors": errors, "samples": samples}))
    dist.destroy_process_group()


# -- the parent: launch, summarize, write results -------------------------------------------
def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    samples = raw["samples"]
    rows: dict[str, Any] = {}
    for w in WRITERS:
        s = [x for x in samples if x["writer"] == w]
        if not s:
            continue
        kept = [x["kept"] for x in s]
        rows[w] = {
            "rounds": len(s),
            "kept": statistics.median(kept),
            "kept_min": min(kept),
            "kept_max": max(kept),
            "base_iters_per_s": statistics.median(x["base"]["iters_per_s"] for x in s),
            "during_iters_per_s": statistics.median(x["during"]["iters_per_s"] for x in s),
            "save_s": statistics.median(x["save_s"] for x in s),
            "call_s": statistics.median(x["call_s"] for x in s),
            **{
                f"{when}_{k}": statistics.median(x[when][k] for x in s)
                for when in ("base", "during")
                for k in ("busy_cores", "loop_on_cpu", "loop_cpu_queued", "loop_off_cpu", "loop_sleeps_per_s")
            },
        }
    sk = rows.get("sk_process")
    return {
        "info": raw["info"],
        "writers": rows,
        "errors": raw["errors"],
        "samples": samples,
        "target": f"sk_process keeps >= {TARGET} of the loop's speed during the save",
        "target_met": None if sk is None else sk["kept"] >= TARGET,
    }


def markdown(res: dict[str, Any], command: str) -> str:
    i = res["info"]
    m = i.get("machine", {})
    lines = [
        f"# A Python-heavy thread beside one async save ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`: one process, a loop thread of tiny torch ops on 16-element CPU tensors beside "
        f"one async save of {i['state_bytes'] / 2**20:.0f} MiB ({i['tensors']} float32 tensors); "
        f"{i['repeats']} rounds after a warm-up save each, writers alternating (order rotated each round); "
        f"{m.get('cpus')} CPUs, {m.get('platform')}, torch {i['torch']}; load average before "
        f"{i['loadavg_before'][0]:.2f}, after {i.get('loadavg_after', [float('nan')])[0]:.2f}."
        + (f" shardkeeper options: `{i['sk_options']}`." if i.get("sk_options", "{}") != "{}" else ""),
        "",
        "| writer | kept (median) | min - max | loop it/s without | loop it/s during | save (s) "
        "| save() call (s) | busy cores without / during |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w, r in res["writers"].items():
        lines.append(
            f"| {w} | {r['kept']:.3f} | {r['kept_min']:.3f} - {r['kept_max']:.3f} | "
            f"{r['base_iters_per_s']:.0f} | {r['during_iters_per_s']:.0f} | {r['save_s']:.3f} | {r['call_s']:.3f} | "
            f"{r['base_busy_cores']:.2f} / {r['during_busy_cores']:.2f} |"
        )
    lines += [
        "",
        "Where the loop thread's time went (fractions of the window, without / during the save): on a CPU; "
        "runnable but waiting for a CPU (other threads and processes, on this machine and beside it); "
        "neither; and how often per second it went to sleep (voluntary context switches: each wait for the "
        "GIL is one). Time in neither with next to no sleeps is not the GIL: it is time the kernel accounted "
        "to no state of the thread (on a virtual machine, time its virtual CPU did not run).",
        "",
        "| writer | on a CPU | waiting for a CPU | neither | sleeps/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for w, r in res["writers"].items():
        cells = [
            f"{r[f'base_{k}']:.2f} / {r[f'during_{k}']:.2f}" for k in ("loop_on_cpu", "loop_cpu_queued", "loop_off_cpu")
        ]
        cells.append(f"{r.get('base_loop_sleeps_per_s', 0):.0f} / {r.get('during_loop_sleeps_per_s', 0):.0f}")
        lines.append(f"| {w} | {' | '.join(cells)} |")
    queued = max((r["base_loop_cpu_queued"] for r in res["writers"].values()), default=0.0)
    if queued > BUSY_QUEUED:
        lines += [
            "",
            f"**A busy machine**: even with no save the loop thread waited for a CPU {queued:.0%} of the time "
            "(other load beside this benchmark), so these fractions measure the contention for the CPUs as much "
            "as for the GIL; compare them with a run on an idle machine.",
        ]
    met = res["target_met"]
    lines += [
        "",
        f"Target: {res['target']}: {'not measured' if met is None else 'PASS' if met else 'MISS'}.",
        "",
        "Kept = the loop's iterations/s from the `save()` call until the save is committed / its "
        "iterations/s in a window with no save just before (as long as that writer's previous save, "
        "at least 1 s). save = from the call until committed; save() call = how long the call blocked "
        "(the loop thread runs on meanwhile); busy cores = busy CPU seconds of the whole machine (every "
        "process: the persist or DCP daemon process too, and any other load) per second of the window.",
        "",
    ]
    for w, e in res["errors"].items():
        lines += [f"**{w} failed**, left out from then on: `{e}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=512.0, help="the state saved, in all")
    ap.add_argument("--repeats", type=int, default=5, help="rounds after the warm-up")
    ap.add_argument("--writers", default=",".join(WRITERS), help=f"comma-separated subset of {','.join(WRITERS)}")
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 16 MiB, 1 round (results: gil-<date>-quick.json)"
    )
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--workdir", default=None, help="where the fresh work dir goes (default: the system temp dir)")
    ap.add_argument("--timeout-s", type=float, default=540.0)
    ap.add_argument("--sk-options", default="{}", help="JSON: keyword options for both shardkeeper managers")
    ap.add_argument("--tag", default="", help="a suffix of the results' names: gil-<date>-<tag>")
    ap.add_argument("--save-timeout-s", type=float, default=120.0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats = 16.0, 1
    unknown = set(args.writers.split(",")) - set(WRITERS)
    if unknown:
        ap.error(f"unknown --writers {sorted(unknown)}; choose from {', '.join(WRITERS)}")
    try:
        if not isinstance(json.loads(args.sk_options), dict):
            raise ValueError("not an object")
    except ValueError as e:
        ap.error(f"--sk-options must be a JSON object of manager options, like '{{\"io_threads\": 1}}': {e}")
    if args.worker:
        worker(args)
        return 0
    command = "python benchmarks/gil.py " + " ".join(argv if argv is not None else sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="sk-gil-", dir=args.workdir))
    try:
        fwd = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("quick", "worker", "workdir", "results_dir", "timeout_s", "tag")
        ]
        cmd = [sys.executable, __file__, "--worker", f"--workdir={work}", *fwd]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        from shardkeeper.core.testing.procs import kill_tree

        child = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            child.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"gil benchmark: no end within {args.timeout_s:.0f} s; stopped", file=sys.stderr)
        finally:
            if child.poll() is None:
                kill_tree(child)
        child.wait()
        raw_file = work / "gil-raw.json"
        if child.returncode != 0:
            print(f"gil benchmark failed (exit {child.returncode})", file=sys.stderr)
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
        stem = "-".join(
            ["gil", time.strftime("%Y-%m-%d"), *([args.tag] if args.tag else []), *(["quick"] if args.quick else [])]
        )
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text(md)
        print(f"wrote {out / stem}.json and .md")
        return 0 if not res["partial"] else (child.returncode or 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
