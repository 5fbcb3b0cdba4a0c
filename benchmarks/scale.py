"""How commit, restore planning, manifest size and store traffic grow with the world size.

    python benchmarks/scale.py [--ranks 8,64,256,1024,4096,16384] [--tensors 2000] [--extra 100000x8]
                               [--layouts described,sharded] [--out-dir benchmarks/results] [--quick]

Every point is ``case_e.py --ranks R --tensors T --layout L`` in its own process, with a
timeout, for each layout: ``described`` (row sharding recorded by its rule, docs/format.md
3.8) and ``sharded`` (the same chunks enumerated in the manifest). An enumerated point whose
predicted memory (the largest bytes per chunk measured so far, times its chunks) exceeds 85%
of the available memory is skipped and recorded as such; DCP's figures (the same chunks) are
measured in the first layout's points up to ``--dcp-max-chunks``. Writes
``scale-<date>[-quick].json`` (every point as case_e.py gives it), ``.md`` (the table) and
``.png`` (log-log, time and size against ranks, shardkeeper and DCP; skipped without
matplotlib; ``--render FILE.json`` writes the .md and .png again from any Python, torch not
needed). ``--extra TxR,...`` adds points of other sizes, T tensors x R ranks (default: case
(e), 100,000 x 8); they are in the table, not the chart.

``--pairs N`` (default 3) then measures the targets' ratios to 64 ranks: the 64-rank point
and the largest one, alternately, N times each (``described``, no DCP), so that both sides
of a ratio ran within a minute of each other on a machine whose speed drifts over a sweep;
each pair's ratio compares the fastest repeats (``*_min_s``: noise only adds time), the
medians beside them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
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
    ranks: int, tensors: int, layout: str, work: Path, timeout_s: float, repeats: int | None, dcp: bool = True
) -> dict[str, Any]:
    out = work / f"point-{layout}-{ranks}x{tensors}.json"
    cmd = [sys.executable, str(HERE / "case_e.py"), "--ranks", str(ranks), "--tensors", str(tensors)]
    cmd += ["--layout", layout, "--out", str(out), "--workdir", str(work / f"w-{layout}-{ranks}x{tensors}")]
    cmd += ["--repeats", str(repeats)] if repeats else []
    cmd += [] if dcp else ["--no-dcp"]
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


def sweep(
    points: list[tuple[int, int]],
    layout: str,
    work: Path,
    timeout_s: float,
    repeats: int | None,
    dcp_max_chunks: int = 0,
) -> list[Any]:
    per_chunk = float(FIRST_GUESS)
    results = []
    for ranks, tensors in points:
        chunks = ranks * tensors
        # described: the manifest and plan hold ranks + tensors entries, not chunks (the guard
        # is for the enumerated form); DCP's figures enumerate every chunk either way
        dcp = chunks <= dcp_max_chunks
        need = BASE_RSS + per_chunk * (chunks if layout != "described" or dcp else ranks + tensors)
        avail = _available()
        if need > 0.85 * avail:
            results.append(
                {
                    "layout": layout,
                    "ranks": ranks,
                    "tensors": tensors,
                    "status": "skipped",
                    "error": f"predicted {need / 2**30:.1f} GiB > 85% of {avail / 2**30:.1f} GiB available",
                }
            )
            continue
        res = run_point(ranks, tensors, layout, work, timeout_s, repeats, dcp)
        if not dcp and "status" not in res:
            res["dcp_note"] = f"DCP not measured: {chunks:,} chunks, above --dcp-max-chunks {dcp_max_chunks:,}"
        measured_all = layout != "described" or dcp
        if measured_all and isinstance(res.get("peak_rss_bytes"), int) and res.get("chunks", 0) >= 100_000:
            per_chunk = max(per_chunk, (res["peak_rss_bytes"] - BASE_RSS) / res["chunks"])
        print(f"scale:   {_line(res)}", flush=True)
        results.append(res)
    return results


def ratio_pairs(
    base: int, top: int, tensors: int, work: Path, timeout_s: float, repeats: int | None, n: int
) -> dict[str, Any]:
    """``n`` alternations of the ``base``-rank and ``top``-rank described points (see the
    module docstring): each pair's runs and ratios, and the median ratio over the pairs."""
    pairs: list[dict[str, Any]] = []
    for i in range(n):
        where = work / f"pair-{i}"  # (a point's files are per save attempt: a fresh root each run)
        where.mkdir(parents=True, exist_ok=True)
        a = run_point(base, tensors, "described", where, timeout_s, repeats, dcp=False)
        b = run_point(top, tensors, "described", where, timeout_s, repeats, dcp=False)
        shutil.rmtree(where, ignore_errors=True)
        pair: dict[str, Any] = {"base": a, "top": b}
        for k in ("commit_min_s", "plan_min_s", "commit_s", "plan_s", "manifest_bytes"):
            if isinstance(a.get(k), (int, float)) and isinstance(b.get(k), (int, float)) and a[k] > 0:
                pair[k.removesuffix("_s").removesuffix("_bytes") + "_ratio"] = b[k] / a[k]
        pairs.append(pair)
        print(f"scale:   pair: {top} / {base} ranks: {_ratios(pair)}", flush=True)
    names = sorted({k for p in pairs for k in p if k.endswith("_ratio")})
    return {
        "base_ranks": base,
        "top_ranks": top,
        "tensors": tensors,
        "pairs": pairs,
        "median": {k: statistics.median(p[k] for p in pairs if k in p) for k in names if any(k in p for p in pairs)},
    }


def _ratios(pair: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}x" for k, v in pair.items() if k.endswith("_ratio")) or "not measured"


def ratio_table(doc: dict[str, Any]) -> str:
    r = doc.get("ratios")
    if not r:
        return ""
    base, top = r["base_ranks"], r["top_ranks"]
    rows = [
        f"## Ratios, {top:,} to {base} ranks ({r['tensors']} tensors, described), measured in alternation\n",
        f"| pair | commit min {base} / {top:,} | ratio | commit median ratio | plan min {base} / {top:,} | ratio "
        f"| plan median ratio | manifest ratio |",
        "|" + "---|" * 8,
    ]
    for i, p in enumerate(r["pairs"], 1):
        a, b = p["base"], p["top"]
        rows.append(
            f"| {i} | {_f(a.get('commit_min_s'))} / {_f(b.get('commit_min_s'))} | {_f(p.get('commit_min_ratio'), 1, '{:.2f}x')} "
            f"| {_f(p.get('commit_ratio'), 1, '{:.2f}x')} | {_f(a.get('plan_min_s'))} / {_f(b.get('plan_min_s'))} "
            f"| {_f(p.get('plan_min_ratio'), 1, '{:.2f}x')} | {_f(p.get('plan_ratio'), 1, '{:.2f}x')} "
            f"| {_f(p.get('manifest_ratio'), 1, '{:.2f}x')} |"
        )
    m = r["median"]
    rows.append(
        f"| median | | {_f(m.get('commit_min_ratio'), 1, '{:.2f}x')} | {_f(m.get('commit_ratio'), 1, '{:.2f}x')} | "
        f"| {_f(m.get('plan_min_ratio'), 1, '{:.2f}x')} | {_f(m.get('plan_ratio'), 1, '{:.2f}x')} "
        f"| {_f(m.get('manifest_ratio'), 1, '{:.2f}x')} |"
    )
    return "\n".join(rows) + "\n"


def _f(v: Any, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(v / scale) if isinstance(v, (int, float)) else "-"


def _t(p: dict[str, Any], name: str) -> str:
    """Wall seconds, then this process's CPU seconds (on a loaded machine the steadier) and,
    where measured, the fastest of the repeats."""
    least = f"; min {_f(p[name + '_min_s'])}" if name + "_min_s" in p else ""
    return f"{_f(p.get(name + '_s'))} ({_f(p.get(name + '_cpu_s'))}{least})"


def _line(p: dict[str, Any]) -> str:
    if "status" in p:
        return f"{p['ranks']} x {p['tensors']}: {p['status']} ({p.get('error')})"
    return f"commit {p['commit_s']:.3f} s, plan {p['plan_s']:.3f} s, manifest {p['manifest_bytes'] / MB:.1f} MB"


HEADER = (
    "| layout | ranks | tensors | chunks | commit_s (CPU; min) | plan_s (CPU; min) | manifest MB | store MB | store round trips "
    "| DCP .metadata MB | DCP unpickle s | DCP plan s (CPU) | load |\n|" + "---|" * 13
)


def table(points: list[dict[str, Any]]) -> str:
    rows = [HEADER]
    for p in points:
        lay = p.get("layout", "")
        if "status" in p:
            rows.append(f"| {lay} | {p['ranks']} | {p['tensors']} | {p['status']}: {p.get('error', '')} |" + " |" * 9)
            continue
        rows.append(
            f"| {lay} | {p['ranks']} | {p['tensors']} | {p['chunks']:,} | {_t(p, 'commit')} | {_t(p, 'plan')} "
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
        f"layouts {', '.join(_layouts(doc))}, float32 tensors of max(1024, ranks) x 256 rows split by torch.chunk's "
        f"rule (described: recorded by that rule, format.md 3.8; sharded: every chunk enumerated).\n\n"
        f"{table(pts)}\n\ncommit_s: rank 0 collects the reports from the store, merges and checks the tiling, "
        f"serializes and durably writes the manifest. plan_s: rank 0 reads and validates the manifest and plans "
        f"the reads of its shard. DCP: the same chunks' pickled Metadata; plan = read + unpickle + "
        f"create_default_local_load_plan for rank 0. load: the machine's 1-minute load average after the point "
        f"(other work on it skews the timings). Store: {counted}.\n"
        + (f"\n{ratio_table(doc)}" if doc.get("ratios") else "")
    )


def _layouts(doc: dict[str, Any]) -> list[str]:
    return list(doc.get("layouts") or [doc.get("layout", "sharded")])


def chart(doc: dict[str, Any], path: Path) -> str | None:
    """The log-log chart, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    all_pts = [p for p in doc["points"] if "status" not in p and p["tensors"] == doc["tensors"]]
    if len(all_pts) < 2:
        return "fewer than two measured points at --tensors: no chart"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    # CPU seconds of the point's process (wall seconds where a point lacks them): steadier on a shared machine
    for layout in _layouts(doc):
        pts = sorted((p for p in all_pts if p.get("layout", layout) == layout), key=lambda p: p["ranks"])
        x = [p["ranks"] for p in pts]
        for k, label in (("commit", "commit"), ("plan", "plan (1 rank)")):
            a.plot(x, [p.get(k + "_cpu_s", p[k + "_s"]) for p in pts], "o-", label=f"shardkeeper {layout} {label}")
        for k, label in (("manifest_bytes", "manifest"), ("store_bytes", "store traffic")):
            b.plot(x, [p[k] / MB for p in pts], "o-", label=f"shardkeeper {layout} {label}")
    dcp = sorted((p for p in all_pts if "dcp_plan_s" in p), key=lambda p: p["ranks"])
    a.plot(
        [p["ranks"] for p in dcp],
        [p.get("dcp_plan_cpu_s", p["dcp_plan_s"]) for p in dcp],
        "s--",
        label="DCP read + unpickle + plan (1 rank)",
    )
    b.plot([p["ranks"] for p in dcp], [p["dcp_metadata_bytes"] / MB for p in dcp], "s--", label="DCP .metadata")
    for ax, ylabel in ((a, "CPU seconds"), (b, "MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['tensors']} tensors, row-sharded: metadata cost vs world size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,256,1024,4096,16384")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--extra", default="100000x8", help="more points, TENSORSxRANKS, comma-separated ('' for none)")
    ap.add_argument("--layouts", default="described,sharded", help="comma-separated: described, sharded, whole")
    ap.add_argument("--dcp-max-chunks", type=int, default=2_100_000, help="DCP's figures up to this many chunks")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", help="output file stem (default scale-<date>[-quick])")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    ap.add_argument("--repeats", type=int, help="passed to case_e.py (default: 3, 1 above 1M chunks)")
    ap.add_argument("--quick", action="store_true", help="small points: 4,16,64 ranks x 200 tensors, no extra")
    ap.add_argument("--pairs", type=int, default=3, help="alternations of 64 ranks and the largest point (0: none)")
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
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in ("described", "sharded", "whole")]
    if bad or not layouts:
        ap.error(f"--layouts: unknown {bad} (described, sharded, whole)")
    points = parse_points(args.ranks, args.tensors, args.extra)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"scale-{_dt.date.today().isoformat()}{'-quick' if args.quick else ''}"
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        results = []
        for i, layout in enumerate(layouts):  # DCP's figures (the same chunks) in the first layout's points
            results += sweep(
                points, layout, Path(tmp), args.timeout, args.repeats, args.dcp_max_chunks if i == 0 else 0
            )
        top = max((r for r, t in points if t == args.tensors), default=0)
        ratios = (
            ratio_pairs(64, top, args.tensors, Path(tmp), args.timeout, args.repeats, args.pairs)
            if args.pairs > 0 and "described" in layouts and top > 64
            else None
        )
    doc = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_available_gib": round(_available() / 2**30, 1),
            "python": platform.python_version(),
        },
        "layouts": layouts,
        "tensors": args.tensors,
        "points": results,
        **({"ratios": ratios} if ratios else {}),
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text(markdown(doc))
    why = chart(doc, out_dir / f"{stem}.png")
    if why:
        print(f"scale: {why}", flush=True)
    print(table(results), flush=True)
    print(ratio_table(doc), flush=True)
    return out_dir / f"{stem}.json"


if __name__ == "__main__":
    main()
