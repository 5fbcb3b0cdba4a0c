"""shardkeeper benchmark: shardkeeper against torch.save/load, torch.distributed.checkpoint (DCP)
and the raw limits of the machine, in one run and on the same state.

    python benchmarks/run.py                      # the full run: 256 and 1024 MiB per rank
    python benchmarks/run.py --quick              # a smoke run (tiny sizes, 1 round), < 1 min
    python3 -m nox -s bench -- --sizes 256 --repeats 3

Cases (``--cases``, default all):
  a  FSDP2 at world size 2, ``--sizes`` MiB per rank of parameters + AdamW state: every save
     method (stall, time to committed) and every restore method, same world size
  b  10,000 small tensors (a plain dict, world size 1)
  c  the case-a checkpoints restored at world size 3 (a separate torchrun launch)
  d  a partial restore of one layer of the case-a checkpoints (model/layers.3.*)
  e  a manifest with 100,000 tensors from 8 ranks: commit and restore planning time (stub,
     benchmarks/case_e.py)

Each case runs as ``torchrun --standalone`` launches of benchmarks/worker.py (one per world
size), each under a timeout, with OMP_NUM_THREADS=1. Everything is written under a fresh work
directory (``--workdir``, default under /tmp) that is deleted at the end. Results go to
benchmarks/results/<date>.{json,md,png} and the README's "Benchmarks" section (not with --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _proc  # noqa: E402
import report  # noqa: E402

from shardkeeper.core.testing.procs import kill_tree  # noqa: E402

NOTES = [
    "Every rank saves and restores its own local state at the same time, as in training.",
    "Every save method starts from what a user holds, the module and the optimizer:",
    "DCP and torch.save times include get_state_dict (and, for torch.save, taking the local shards);",
    "DCP load times include get_state_dict and set_state_dict; torch.load times include copying the",
    "loaded tensors into the live ones. All saves are durable when timed as committed: shardkeeper and",
    "DCP fsync their files, torch.save and the raw write are followed by fsync. Stall = how long the",
    "save call blocks the caller; time to committed = save call until the handle/future is done.",
    "Restores are cold: before each one every file of the work dir is fsync'ed and dropped from the",
    "page cache (posix_fadvise POSIX_FADV_DONTNEED), so reads come from the disk; a warm-cache",
    "restore follows each cold one. Rounds alternate the method order (rotated by one per round);",
    "each round writes to its own directory (a new step for shardkeeper) and restores read their own",
    "round's files; a warm-up round precedes the measured ones. Per round the ranks are combined",
    "(times: slowest rank; bytes, CPU seconds: summed; RSS: worst rank); reported values are medians",
    "over rounds. Peak RSS = (VmHWM after the restore, reset through /proc/self/clear_refs before it,",
    "minus RSS before the target state was allocated) / state size on the rank. Bytes read:",
    "shardkeeper's last_restore_stats (rchar of /proc/self/io as a cross-check, and for DCP). The",
    "digest cost is xxh3_128 over the rank's state in 1 MiB blocks, timed alone. DCP async_save runs",
    "in thread mode; its reused stager is one DefaultStager(StagingOptions(False, False, False, False))",
    "passed as async_stager= to every call (on CPU: no pinned or shared memory, synchronous staging).",
]


# -- launching -------------------------------------------------------------------------------------
class LaunchError(RuntimeError):
    pass


LAUNCH_CONTEXT: dict[str, dict[str, Any]] = {}  # per launch: the machine's state just before it
CORE_SRC: Path | None = None  # the snapshot of packages/core/src every launch imports (see --core)


def launch(label: str, nproc: int | None, args: list[str], *, timeout_s: float, logdir: Path) -> float:
    """Run worker.py under torchrun (or a plain script when nproc is None); kill it on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if CORE_SRC is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CORE_SRC), env.get("PYTHONPATH", "")) if p)
    if nproc is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "worker.py"),
            *args,
        ]
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{label}.log"
    busy = _proc.cpu_busy(1.0)  # nothing of ours runs now: this is everybody else
    LAUNCH_CONTEXT[label] = {"others_cpu_busy": busy, "load_avg": os.getloadavg()}
    print(
        f"[{label}] {'world ' + str(nproc) if nproc else 'one process'}, timeout {timeout_s:.0f} s; "
        f"other processes kept {busy:.0%} of the CPUs busy"
        f"{' (a busy machine: numbers may be noisy)' if busy > 0.25 else ''}",
        flush=True,
    )
    t0 = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc, grace_s=10)
            raise LaunchError(f"[{label}] timed out after {timeout_s:.0f} s; log: {log}") from None
        except BaseException:
            kill_tree(proc, grace_s=10)
            raise
        finally:
            kill_tree(proc, grace_s=10)  # anything the launch left behind, in any session
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text()[-4000:]
        raise LaunchError(f"[{label}] exited with {rc} after {wall:.0f} s; log {log}:\n{tail}")
    print(f"[{label}] done in {wall:.1f} s", flush=True)
    return wall


def timeout_for(size_mib: float, world: int, rounds: int, scale: float) -> float:
    """Generous: 180 s to start, then 16 passes over the state per round (warm-up included),
    every rank at 20 MB/s (10-50x slower than a disk), times ``scale``."""
    return scale * (180 + (rounds + 1) * 16 * world * size_mib * 0.05)


def read_ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024", help="MiB of state per rank for cases a, c, d (default 256,1024)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured rounds per case (default: 5 up to 256 MiB, 3 above; 5 for case b)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 MiB, 1,000 small tensors, 1 round, no warm-up round, no warm-cache restores; "
        "results as <date>-quick.*, README untouched",
    )
    ap.add_argument(
        "--workdir", default=None, help="where the run's fresh work dir is made (default: the system temp dir, /tmp)"
    )
    ap.add_argument("--cases", default="a,b,c,d,e")
    ap.add_argument(
        "--core",
        default="tree",
        help="which shardkeeper core to measure: 'tree' (default: a copy of packages/core/src "
        "taken at the start, so edits during the run do not mix versions), a git revision "
        "(e.g. HEAD: that commit's packages/core/src), or 'installed' (whatever imports)",
    )
    ap.add_argument("--n-tensors", type=int, default=10_000, help="case b")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-cache restores")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument(
        "--no-readme",
        action="store_true",
        help="do not update README.md (it is only updated by a full run, every case at the default "
        "sizes, that writes to benchmarks/results; other runs write <date>-cases-<cases>.*)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work dir (checkpoints, logs)")
    ap.add_argument(
        "--report-only",
        metavar="JSON",
        help="measure nothing: redo the ratios, tables, chart (and README) from a results file",
    )
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every launch's timeout")
    args = ap.parse_args(argv)
    args.cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = args.cases - set("abcde")
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from a,b,c,d,e")
    args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    if args.quick:
        args.sizes = [16.0]
        args.repeats = 1
        args.n_tensors = min(args.n_tensors, 1000)
        args.no_warm = True
    return args


def _size_label(size: float) -> str:
    return f"{size:g}"


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        results = json.loads(Path(args.report_only).read_text())
        rerender(results)
        args.quick = results["args"].get("quick", False)
        write_outputs(args, results)
        return 0
    signal.signal(signal.SIGTERM, _sigterm)  # so that a kill still ends the launches and the work dir
    t_start = time.perf_counter()
    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shardkeeper-bench-", dir=base))
    logs = work / "logs"
    command = "python benchmarks/run.py" + (
        "" if not (argv or sys.argv[1:]) else " " + shlex.join(argv or sys.argv[1:])
    )
    print(
        f"shardkeeper benchmark: {command}\nwork dir {work} (deleted at the end{'; kept: --keep' if args.keep else ''})",
        flush=True,
    )
    print(
        "restores are cold: before each, every file written is fsync'ed and dropped from the page "
        "cache with posix_fadvise(POSIX_FADV_DONTNEED), so reads hit the disk; warm-cache restores "
        "follow" + (" (--no-warm: skipped)" if args.no_warm else ""),
        flush=True,
    )
    machine = _proc.machine_info(str(work), ROOT)
    machine["core_source"] = snapshot_core(args.core, work / "core-src")
    samples: list[dict[str, Any]] = []
    infos: dict[str, list[dict[str, Any]]] = {}
    launches: list[dict[str, Any]] = []
    errors: list[str] = []
    case_e: dict[str, Any] | None = None

    def run_launch(label: str, nproc: int | None, wargs: list[str], timeout_s: float, out: Path | None) -> None:
        try:
            wall = launch(label, nproc, wargs, timeout_s=timeout_s, logdir=logs)
            launches.append(
                {"label": label, "world": nproc, "wall_s": wall, "ok": True, **LAUNCH_CONTEXT.get(label, {})}
            )
        except LaunchError as e:
            print(str(e), file=sys.stderr, flush=True)
            errors.append(str(e).splitlines()[0])
            launches.append(
                {"label": label, "world": nproc, "ok": False, "error": str(e)[:4000], **LAUNCH_CONTEXT.get(label, {})}
            )
        if out is not None and out.exists():  # what it measured before failing counts too
            for r in read_ranks(out):
                infos.setdefault(label, []).append(r["info"])
                samples.extend(r["samples"])

    try:
        warm = ([] if args.no_warm else ["--warm"]) + (["--no-warmup"] if args.quick else [])
        if args.cases & {"a", "c", "d"}:
            for size in args.sizes:
                sl = _size_label(size)
                rounds = args.repeats or (5 if size <= 256 else 3)
                cdir = work / f"fsdp-{sl}"
                need = 2 * size * 2**20 * (3 * rounds + 3)
                free = shutil.disk_usage(work).free
                if free < need * 1.1:
                    msg = f"[a-{sl}] skipped: needs ~{need / 2**30:.1f} GiB of disk, {free / 2**30:.1f} GiB free"
                    print(msg, file=sys.stderr, flush=True)
                    errors.append(msg)
                    continue
                if mem_available() < 2 * size * 2**20 * 6:
                    print(
                        f"[a-{sl}] warning: {mem_available() / 2**30:.1f} GiB RAM available, "
                        f"~{2 * size * 6 / 1024:.1f} GiB wanted",
                        flush=True,
                    )
                common = [
                    "--state",
                    "fsdp",
                    "--size-mib",
                    str(size),
                    "--world-save",
                    "2",
                    "--repeats",
                    str(rounds),
                    "--dir",
                    str(cdir),
                ]
                save_methods = [] if "a" in args.cases else ["--save-methods", "dcp_save,sk_sync"]
                restore_methods = [] if "a" in args.cases else ["--restore-methods", ""]
                partial = ["--partial-label", f"d-{sl}"] if "d" in args.cases else []
                out = work / "out" / f"a-{sl}"
                run_launch(
                    f"a-{sl}",
                    2,
                    [
                        *common,
                        "--out",
                        str(out),
                        "--phases",
                        "save,restore",
                        "--save-label",
                        f"a-{sl}",
                        "--restore-label",
                        f"a-{sl}",
                        *save_methods,
                        *restore_methods,
                        *partial,
                        *warm,
                    ],
                    timeout_for(size, 2, rounds, args.timeout_scale),
                    out,
                )
                if "c" in args.cases and launches[-1]["ok"]:
                    out = work / "out" / f"c-{sl}"
                    run_launch(
                        f"c-{sl}",
                        3,
                        [
                            *common,
                            "--out",
                            str(out),
                            "--phases",
                            "restore",
                            "--restore-label",
                            f"c-{sl}",
                            "--restore-methods",
                            "dcp_load,sk_restore",
                            *warm,
                        ],
                        timeout_for(size, 3, rounds, args.timeout_scale),
                        out,
                    )
                shutil.rmtree(cdir, ignore_errors=True)
        if "b" in args.cases:
            rounds = args.repeats or 5
            out = work / "out" / "b"
            run_launch(
                "b",
                1,
                [
                    "--state",
                    "small",
                    "--n-tensors",
                    str(args.n_tensors),
                    "--repeats",
                    str(rounds),
                    "--dir",
                    str(work / "small"),
                    "--out",
                    str(out),
                    "--phases",
                    "save,restore",
                    "--save-label",
                    "b",
                    "--restore-label",
                    "b",
                    *warm,
                ],
                timeout_for(args.n_tensors * 4.5 / 1024, 1, rounds, args.timeout_scale) + 120,
                out,
            )
            shutil.rmtree(work / "small", ignore_errors=True)
        if "e" in args.cases:
            out_e = work / "out" / "e.json"
            out_e.parent.mkdir(parents=True, exist_ok=True)
            run_launch(
                "e",
                None,
                [
                    str(HERE / "case_e.py"),
                    "--workdir",
                    str(work / "e"),
                    "--out",
                    str(out_e),
                    *(["--quick"] if args.quick else []),
                ],
                600 * args.timeout_scale,
                None,
            )
            case_e = json.loads(out_e.read_text()) if out_e.exists() else {"status": "failed", "error": "no output"}
    except KeyboardInterrupt:
        errors.append("interrupted")
        print("interrupted; writing what was measured", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    wall = time.perf_counter() - t_start
    results = assemble(args, command, machine, samples, infos, launches, errors, case_e, wall)
    write_outputs(args, results)
    print(f"total wall time {wall / 60:.1f} min", flush=True)
    return 1 if errors else 0


def snapshot_core(which: str, dest: Path) -> dict[str, Any]:
    """Copy the core's sources that every launch of this run imports; describe what was copied."""
    global CORE_SRC
    src = ROOT / "packages" / "core" / "src"
    if which == "installed":
        CORE_SRC = None
        return {"mode": "installed"}
    dest.mkdir(parents=True)
    if which == "tree":
        shutil.copytree(
            src / "shardkeeper", dest / "shardkeeper", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        desc = {"mode": "working tree", "rev": machine_rev()}
    else:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", which, "packages/core/src/shardkeeper"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest), "--strip-components=3"], input=archive, check=True, timeout=60)
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", which],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        desc = {"mode": "git revision", "rev": rev}
    h = hashlib.sha256()
    for p in sorted(dest.rglob("*.py")):
        h.update(str(p.relative_to(dest)).encode())
        h.update(p.read_bytes())
    CORE_SRC = dest
    return {**desc, "sources_sha256": h.hexdigest()[:16]}


def machine_rev() -> str:
    try:
        return (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            + "+working-tree"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def assemble(
    args: argparse.Namespace,
    command: str,
    machine: dict[str, Any],
    samples: list[dict[str, Any]],
    infos: dict[str, list[dict[str, Any]]],
    launches: list[dict[str, Any]],
    errors: list[str],
    case_e: dict[str, Any] | None,
    wall: float,
) -> dict[str, Any]:
    combined = report.combine(samples)
    med = report.medians(combined)
    report.add_unit_rows(med)
    rows = report.ratios(combined, med, case_e)
    for m in med.values():
        for v in m.values():
            v.pop("one", None)
    return {
        "date": dt.date.today().isoformat(),
        "finished_at": dt.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "machine": machine,
        "wall_s": wall,
        "notes": NOTES,
        "meta": {"n_tensors": args.n_tensors, "sizes_mib": args.sizes},
        "launches": launches,
        "errors": errors,
        "info": infos,
        "ratios": rows,
        "medians": med,
        "case_e": case_e,
        "samples": samples,
    }


def rerender(results: dict[str, Any]) -> None:
    """Recompute medians and ratios from a results file's raw samples (after a report.py change)."""
    combined = report.combine(results["samples"])
    med = report.medians(combined)
    report.add_unit_rows(med)
    results["ratios"] = report.ratios(combined, med, results.get("case_e"))
    for m in med.values():
        for v in m.values():
            v.pop("one", None)
    results["medians"] = med


#: What a full run measures: only such a run writes ``<date>.*`` and updates the README.
FULL_RUN = {"cases": ["a", "b", "c", "d", "e"], "sizes": [256.0, 1024.0], "n_tensors": 10_000}


def partial_label(run_args: dict[str, Any]) -> str | None:
    """``None`` for a full run; else a file-name label of what it measured (``cases-b``), so
    that a run of some cases never writes over the day's full results or the README."""
    if all(run_args.get(k) == v for k, v in FULL_RUN.items()):
        return None
    label = "cases-" + "".join(run_args.get("cases", []))
    if run_args.get("sizes") != FULL_RUN["sizes"]:
        label += "-" + "_".join(f"{s:g}" for s in run_args.get("sizes", [])) + "MiB"
    if run_args.get("n_tensors") != FULL_RUN["n_tensors"]:
        label += f"-n{run_args.get('n_tensors')}"
    return label


def write_outputs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    outdir = Path(args.results_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    partial = None if args.quick else partial_label(results["args"])
    stem = results["date"] + ("-quick" if args.quick else f"-{partial}" if partial else "")
    jpath, mpath, ppath = outdir / f"{stem}.json", outdir / f"{stem}.md", outdir / f"{stem}.png"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(jpath)
    md = report.markdown(results)
    mpath.write_text(md)
    try:
        report.chart(results, ppath)
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
    print(f"results: {jpath}, {mpath}, {ppath}")
    print()
    print(report.ratio_table(results["ratios"], results["meta"], info=False))
    default_dir = outdir.resolve() == (HERE / "results").resolve()
    if not args.quick and partial is None and not args.no_readme and not results["errors"] and default_dir:

        def rel(p: Path) -> str:
            try:
                return str(p.resolve().relative_to(ROOT))
            except ValueError:
                return str(p)

        report.update_readme(ROOT / "README.md", report.readme_section(results, rel(mpath), rel(ppath), rel(jpath)))
        print("README.md: Benchmarks section updated")


if __name__ == "__main__":
    sys.exit(main())
