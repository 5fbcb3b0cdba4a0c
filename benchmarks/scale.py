"""How commit, restore planning, manifest size and store traffic grow with the world size.

    python benchmarks/scale.py [--ranks 8,64,256,1024] [--tensors 2000] [--extra 100000x8]
                               [--layout sharded] [--out-dir benchmarks/results] [--quick]

Every point is ``case_e.py --ranks R --tensors T`` in its own process, with a timeout; a
point whose predicted memory (the largest bytes per chunk measured so far, times its chunks)
exceeds 85% of the available memory is skipped and recorded as such. Writes
``scale-<date>[-quick].json`` (every point as case_e.py gives it), ``.md`` (the table) and
``.png`` (log-log, time and size against ranks, shardkeeper and DCP; skipped without
matplotlib; ``--render FILE.json`` writes the .md and .png again from any Python, torch not
needed). ``--extra TxR,...`` adds points of other sizes, T tensors x R ranks (default: case
(e), 100,000 x 8); they are in the table, not the chart.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BASE_RSS = 400 << 20  # a point's process before its first chunk (torch imported)
FIRST_GUESS = 4000  # bytes per chunk, the least assumed (points of >= 100,000 chunks raise it)
MB = 1e6


def _available() -> int:
    """MemAvailable from /proc/meminfo (bytes); a large number where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def parse_points(ranks: str, tensors: int, extra: str) -> list[tuple[int, int]]:
    pts = [(int(r), tensors) for r in ranks.split(",") if r.strip()]
    for e in (x for x in extra.split(",") if x.strip()):
        t, _, r = e.lower().partition("x")
        pts.append((int(r), int(t)))
    return sorted(set(pts), key=lambda p: (p[0] * p[1], p))


def run_point(
    ranks: int, tensors: int, layout: str, work: Path, timeout_s: float, repeats: int | None
) -> dict[str, Any]:
    out = work / f"point-{ranks}x{tensors}.json"
    cmd = [sys.executable, str(HERE / "case_e.py"), "--ranks", str(ranks), "--tensors", str(tensors)]
    cmd += ["--layout", layout, "--out", str(out), "--workdir", str(work / f"w-{ranks}x{tensors}")]
    cmd += ["--repeats", str(repeats)] if repeats else []
    print(f"scale: {ranks} ranks x {tensors} tensors ({layout}) ...", flush=True)
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"ranks": ranks, "tensors": tensors, "status": "timeout", "error": f"over {timeout_s:.0f} s"}
    if not out.exists():
        err = (proc.stderr or "").strip().splitlines()[-3:]
        return {"ranks": ranks, "tensors": tensors, "status": "failed", "error": f"rc {proc.returncode}: {err}"}
    res: dict[str, Any] = json.loads(out.read_text())
    res["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # the machine's load: others' work skews timings
    res.setdefault("ranks", ranks)
    res.setdefault("tensors", tensors)
    return res


def sweep(points: list[tuple[int, int]], layout: str, work: Path, timeout_s: float, repeats: int | None) -> list[Any]:
    per_chunk = float(FIRST_GUESS)
    results = []
    for ranks, tensors in points:
        chunks = ranks * tensors
        need = BASE_RSS + per_chunk * chunks
        avail = _available()
        if need > 0.85 * avail:
            results.append(
                {
                    "ranks": ranks,
                    "tensors": tensors,
                    "status": "skipped",
                    "error": f"predicted {need / 2**30:.1f} GiB > 85% of {avail / 2**30:.1f} GiB available",
                }
            )
            continue
        res = run_point(ranks, tensors, layout, work, timeout_s, repeats)
        if isinstance(res.get("peak_rss_bytes"), int) and res.get("chunks", 0) >= 100_000:  # base RSS dominates below
            per_chunk = max(per_chunk, (res["peak_rss_bytes"] - BASE_RSS) / res["chunks"])
        print(f"scale:   {_line(res)}", flush=True)
        results.append(res)
    return results


def _f(v: Any, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(v / scale) if isinstance(v, (int, float)) else "-"


def _t(p: dict[str, Any], name: str) -> str:
    """Wall seconds, then this process's CPU seconds: on a loaded machine the CPU time is the steadier."""
    return f"{_f(p.get(name + '_s'))} ({_f(p.get(name + '_cpu_s'))})"


def _line(p: dict[str, Any]) -> str:
    if "status" in p:
        return f"{p['ranks']} x {p['tensors']}: {p['status']} ({p.get('error')})"
    return f"commit {p['commit_s']:.3f} s, plan {p['plan_s']:.3f} s, manifest {p['manifest_bytes'] / MB:.1f} MB"


HEADER = (
    "| ranks | tensors | chunks | commit_s (CPU) | plan_s (CPU) | manifest MB | store MB | store round trips "
    "| DCP .metadata MB | DCP unpickle s | DCP plan s (CPU) | load |\n|" + "---|" * 12
)


def table(points: list[dict[str, Any]]) -> str:
    rows = [HEADER]
    for p in points:
        if "status" in p:
            rows.append(f"| {p['ranks']} | {p['tensors']} | {p['status']}: {p.get('error', '')} |" + " |" * 9)
            continue
        rows.append(
            f"| {p['ranks']} | {p['tensors']} | {p['chunks']:,} | {_t(p, 'commit')} | {_t(p, 'plan')} "
            f"| {_f(p['manifest_bytes'], MB, '{:.2f}')} | {_f(p['store_bytes'], MB, '{:.2f}')} "
            f"| {p['store_round_trips']:,} | {_f(p.get('dcp_metadata_bytes'), MB, '{:.2f}')} "
            f"| {_f(p.get('dcp_unpickle_s'))} | {_t(p, 'dcp_plan')} "
            f"| {_f(p.get('load_avg_1m_after'), 1, '{:.1f}')} |"
        )
    return "\n".join(rows)


def markdown(doc: dict[str, Any]) -> str:
    pts = doc["points"]
    counted = next((p["store_counted"] for p in pts if "store_counted" in p), "")
    return (
        f"# World-size sweep, {doc['date']}\n\n`{doc['command']}`\n\n"
        f"Machine: {doc['machine']['cpus']} CPUs, {doc['machine']['mem_available_gib']:.0f} GiB available; "
        f"layout {doc['layout']}, float32 tensors of max(1024, ranks) x 256 rows split by torch.chunk's rule.\n\n"
        f"{table(pts)}\n\ncommit_s: rank 0 collects the reports from the store, merges and checks the tiling, "
        f"serializes and durably writes the manifest. plan_s: rank 0 reads and validates the manifest and plans "
        f"the reads of its shard. DCP: the same chunks' pickled Metadata; plan = read + unpickle + "
        f"create_default_local_load_plan for rank 0. load: the machine's 1-minute load average after the point "
        f"(other work on it skews the timings). Store: {counted}.\n"
    )


def chart(doc: dict[str, Any], path: Path) -> str | None:
    """The log-log chart, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    pts = [p for p in doc["points"] if "status" not in p and p["tensors"] == doc["tensors"]]
    if len(pts) < 2:
        return "fewer than two measured points at --tensors: no chart"
    pts.sort(key=lambda p: p["ranks"])
    x = [p["ranks"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    # CPU seconds of the point's process (wall seconds where a point lacks them): steadier on a shared machine
    for k, label, st in (
        ("commit", "shardkeeper commit", "o-"),
        ("plan", "shardkeeper plan (1 rank)", "o-"),
        ("dcp_plan", "DCP read + unpickle + plan (1 rank)", "s--"),
    ):
        a.plot(x, [p.get(k + "_cpu_s", p[k + "_s"]) for p in pts], st, label=label)
    for k, label, st in (
        ("manifest_bytes", "shardkeeper manifest", "o-"),
        ("store_bytes", "shardkeeper store traffic", "o-"),
        ("dcp_metadata_bytes", "DCP .metadata", "s--"),
    ):
        b.plot(x, [p[k] / MB for p in pts], st, label=label)
    for ax, ylabel in ((a, "CPU seconds"), (b, "MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['tensors']} tensors, {doc['layout']}: metadata cost vs world size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,256,1024")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--extra", default="100000x8", help="more points, TENSORSxRANKS, comma-separated ('' for none)")
    ap.add_argument("--layout", choices=("sharded", "whole"), default="sharded")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", help="output file stem (default scale-<date>[-quick])")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    ap.add_argument("--repeats", type=int, help="passed to case_e.py (default: 3, 1 above 1M chunks)")
    ap.add_argument("--quick", action="store_true", help="small points: 4,16,64 ranks x 200 tensors, no extra")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the .md and .png of a sweep's .json, beside it")
    args = ap.parse_args(argv)
    if args.render:
        src = Path(args.render)
        doc = json.loads(src.read_text())
        src.with_suffix(".md").write_text(markdown(doc))
        print(chart(doc, src.with_suffix(".png")) or f"scale: wrote {src.with_suffix('.md')} and .png")
        return src
    if args.quick:
        args.ranks, args.tensors, args.extra = "4,16,64", 200, ""
    points = parse_points(args.ranks, args.tensors, args.extra)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"scale-{_dt.date.today().isoformat()}{'-quick' if args.quick else ''}"
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        results = sweep(points, args.layout, Path(tmp), args.timeout, args.repeats)
    doc = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_available_gib": round(_available() / 2**30, 1),
            "python": platform.python_version(),
        },
        "layout": args.layout,
        "tensors": args.tensors,
        "points": results,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text(markdown(doc))
    why = chart(doc, out_dir / f"{stem}.png")
    if why:
        print(f"scale: {why}", flush=True)
    print(table(results), flush=True)
    return out_dir / f"{stem}.json"


if __name__ == "__main__":
    main()
