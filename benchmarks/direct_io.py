"""CPU and wall time of writing a checkpoint to local disk, buffered against O_DIRECT
(docs/decisions.md D19).

    python benchmarks/direct_io.py            # 192 MiB, 4 rounds; ~1 min on 2 cores
    python benchmarks/direct_io.py --quick    # 16 MiB, 1 round

Two pairs, alternating within each round, the page cache flushed (``os.sync``) before each:
(1) a raw write + fsync of the bytes into a new file in 8 MiB writes from page-aligned memory,
buffered and with ``O_DIRECT``; (2) an async shardkeeper save of the same bytes (8 fp32
tensors; staging copy, digests, write, fsync and commit) with ``direct_io`` on and off; (3) a
synchronous save (no staging: written from the tensors' own memory, which with ``direct_io``
goes through the writer's page-aligned bounce buffer). CPU is
the process's user + system time; "machine busy" is the busy time of all CPUs over the write
and one second after it, which includes the kernel's writeback threads. Writes
``benchmarks/results/direct-io-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from shardkeeper.core import CheckpointManager

RESULTS = Path(__file__).parent / "results"
WRITE = 8 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _busy() -> float:
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _measure(fn: Any) -> dict[str, float]:
    os.sync()
    time.sleep(0.3)
    c0, b0, t0 = _cpu(), _busy(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    time.sleep(1.0)  # writeback after the call is the buffered write's cost too
    return {"wall_s": wall, "cpu_s": cpu, "machine_busy_s": _busy() - b0}


def _raw_write(path: Path, data: memoryview, direct: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for off in range(0, len(data), WRITE):
            os.write(fd, data[off : off + WRITE])
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None, help="on the disk to measure (default: the system temp dir)")
    ap.add_argument("--results-dir", default=str(RESULTS), help="where the .json and .md go")
    args = ap.parse_args()
    mib, rounds = (16, 1) if args.quick else (192, 4)
    torch.set_num_threads(1)
    n = mib << 20
    mem = mmap.mmap(-1, n)
    mem.write(
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    )
    data = memoryview(mem)
    state = {f"t{i}": torch.randn(n // 32, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    work = Path(tempfile.mkdtemp(prefix="sk-dio-", dir=args.workdir))
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        managers = {d: CheckpointManager(work / f"sk-{d}", storage_options={"direct_io": d}) for d in (False, True)}
        for mgr in managers.values():
            mgr.save(0, state).wait()  # allocates the staging buffer, plans once
        for r in range(rounds):
            for direct in (False, True) if r % 2 == 0 else (True, False):
                label = "O_DIRECT" if direct else "buffered"
                path = work / f"raw-{r}-{direct}"
                runs.setdefault(f"raw write + fsync, {label}", []).append(
                    _measure(lambda: _raw_write(path, data, direct))  # noqa: B023 - called at once
                )
                path.unlink()
                mgr = managers[direct]
                for kind, is_async in (("async", True), ("sync", False)):
                    step = 2 * r + 1 + (not is_async)
                    runs.setdefault(f"shardkeeper {kind} save, {label}", []).append(
                        _measure(lambda: mgr.save(step, state, async_save=is_async).wait())  # noqa: B023 - called at once
                    )
                    mgr.delete(step)
        for mgr in managers.values():
            mgr.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: round(statistics.median(x[m] for x in v), 4) for m in v[0]} for k, v in runs.items()}
    res = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/direct_io.py" + (" --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "bytes": n,
        "rounds": rounds,
        "median": med,
        "runs": runs,
    }
    lines = [
        f"# Buffered against O_DIRECT writes, {res['date']}",
        "",
        f"`{res['command']}`: {mib} MiB, medians of {rounds} alternating rounds, page cache flushed before each; "
        f"{res['machine']['cpus']} CPUs, {res['machine']['platform']}.",
        "",
        "| write | wall (s) | process CPU (s) | machine busy (s) |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {v['wall_s']:.3f} | {v['cpu_s']:.3f} | {v['machine_busy_s']:.3f} |" for k, v in med.items()),
        "",
        "Process CPU: user + system time of this process over the call. Machine busy: all CPUs' busy time "
        "over the call and the second after it (kernel writeback included; other processes too).",
    ]
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"direct-io-{res['date']}{'-quick' if args.quick else ''}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
