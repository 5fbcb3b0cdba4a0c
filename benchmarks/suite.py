"""Every benchmark of ``nox -s bench``, one after another, each in its own process under a
timeout, so that one that misses a target, fails or hangs never keeps the later ones from running.

    python benchmarks/suite.py [run.py's arguments]     # --quick: every benchmark's smoke run

The arguments go to benchmarks/run.py; ``--quick`` also makes every other benchmark a smoke
run. Each benchmark's output is passed through as it comes; its lines that say MISS (or
MISSED) are kept for the summary printed at the end: one line per benchmark (ok, missed N
targets, failed with its exit status, timed out), then the missed targets' lines. Exit status:
0 when every benchmark ran and met its targets, 1 when one missed a target and none failed,
2 when one failed or timed out (its figures, if it wrote any, are still in benchmarks/results).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: A target's verdict in a benchmark's output (run.py's ratio table, gil.py's target line).
MISS_RE = re.compile(r"\bMISS(ED)?\b")
HOUR = 3600.0


@dataclass(frozen=True)
class Bench:
    """One benchmark: its name, the script and arguments ``python`` runs, and a time limit
    (a backstop: each script bounds its own launches)."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float


@dataclass
class Outcome:
    name: str
    status: str = "ok"  # ok | missed | failed | timed out | interrupted
    returncode: int | None = None
    wall_s: float = 0.0
    misses: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.status == "failed":
            return f"failed (exit {self.returncode})"
        if self.status == "missed":
            return f"missed {len(self.misses)} target{'s' if len(self.misses) != 1 else ''}"
        return self.status


def benches(argv: Sequence[str]) -> list[Bench]:
    """What ``nox -s bench`` runs, in order; ``argv`` goes to run.py."""
    quick = ("--quick",) if "--quick" in argv else ()
    ranks16 = ("--nproc", "4", "--no-s3", "--name", "ranks16-quick") if quick else ()
    return [
        Bench("run", ("benchmarks/run.py", *argv), 4 * HOUR),
        Bench("loop", ("benchmarks/loop.py", *quick), HOUR),
        Bench("gil", ("benchmarks/gil.py", *quick), HOUR),
        Bench("direct_io", ("benchmarks/direct_io.py", *quick), HOUR),
        Bench("scale", ("benchmarks/scale.py", *quick), 2 * HOUR),
        Bench("ranks16", ("benchmarks/ranks16.py", *ranks16), HOUR),
        Bench("tiers", ("benchmarks/tiers.py", *quick), HOUR),
    ]


def run_one(bench: Bench, cwd: Path = ROOT) -> Outcome:
    """Run ``bench``, its output passed through; kill its whole process tree on timeout."""
    from shardkeeper.core.testing.procs import kill_tree

    out = Outcome(bench.name)
    print(f"== {bench.name}: python {' '.join(bench.argv)} (time limit {bench.timeout_s:.0f} s)", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *bench.argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if MISS_RE.search(line):
                out.misses.append(line.strip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        out.returncode = proc.wait(timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        out.status = "timed out"
    except KeyboardInterrupt:
        out.status = "interrupted"
    finally:
        kill_tree(proc, grace_s=10)  # on timeout, and anything it left behind
        reader.join(timeout=30)
    out.wall_s = time.perf_counter() - t0
    if out.status == "ok" and out.returncode != 0:
        out.status = "failed"
    elif out.status == "ok" and out.misses:
        out.status = "missed"
    print(f"== {bench.name}: {out.describe()} after {out.wall_s:.0f} s", flush=True)
    return out


def summary(outcomes: list[Outcome]) -> str:
    lines = ["", "== benchmarks summary", *(f"{o.name:<10} {o.describe():<22} {o.wall_s:8.0f} s" for o in outcomes)]
    for o in outcomes:
        if o.misses:
            lines += ["", f"{o.name}:", *(f"  {m}" for m in o.misses)]
    return "\n".join(lines)


def exit_status(outcomes: list[Outcome]) -> int:
    if any(o.status not in ("ok", "missed") for o in outcomes):
        return 2
    return 1 if any(o.status == "missed" for o in outcomes) else 0


def run_all(suite: Sequence[Bench], cwd: Path = ROOT) -> list[Outcome]:
    """Every benchmark of ``suite``, whatever the earlier ones did; stops early only when interrupted."""
    outcomes: list[Outcome] = []
    for bench in suite:
        outcomes.append(run_one(bench, cwd))
        if outcomes[-1].status == "interrupted":
            break
    return outcomes


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)  # a kill still stops the running benchmark's tree
    outcomes = run_all(benches(list(sys.argv[1:] if argv is None else argv)))
    print(summary(outcomes), flush=True)
    return exit_status(outcomes)


if __name__ == "__main__":
    sys.exit(main())
