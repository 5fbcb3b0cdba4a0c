"""Ratios against the anchors, the markdown table, the chart and the README section.

Samples come per rank and per round (``rep``). For each round the ranks are combined (times:
the slowest rank, since a job waits for it; bytes and CPU seconds: summed over ranks; RSS
ratios: the worst rank), then each metric's median over the rounds is taken. A ratio is the
ratio of two medians; its spread is the range of the per-round ratios.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAX_KEYS = {"stall_s", "committed_s", "wall_s", "sk_stall_s"}
SUM_KEYS = {
    "cpu_s",
    "cpu_user_s",
    "cpu_sys_s",
    "minflt",
    "majflt",
    "bytes_read",
    "bytes_needed",
    "sk_bytes_read",
    "sk_bytes_needed",
    "bytes_written",
    "state_bytes",
    "sk_reads",
}
WORST_KEYS = {"peak_rss_ratio", "extra_rss_ratio"}


def _method_key(s: dict[str, Any]) -> str:
    return s["method"] + ("@warm" if s.get("cache") == "warm" else "")


def combine(samples: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """case -> method -> rep -> metrics, the ranks combined."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        groups[(s["case"], _method_key(s), s["rep"])].append(s)
    out: dict[str, dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for (case, method, rep), ss in groups.items():
        m: dict[str, Any] = {"ranks": len(ss)}
        for k in MAX_KEYS | SUM_KEYS | WORST_KEYS:
            vals = [s[k] for s in ss if s.get(k) is not None]
            if not vals:
                continue
            m[k] = sum(vals) if k in SUM_KEYS else max(vals)
        if any("verified" in s for s in ss):
            m["verified"] = all(s.get("verified", True) for s in ss)
        out[case][method][rep] = m
    return out


def medians(combined: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for case, methods in combined.items():
        out[case] = {}
        for method, reps in methods.items():
            keys = {k for r in reps.values() for k in r if k not in ("ranks", "verified")}
            med: dict[str, Any] = {k: statistics.median(r[k] for r in reps.values() if k in r) for k in keys}
            med["n"] = len(reps)
            if any("verified" in r for r in reps.values()):
                med["verified"] = all(r.get("verified", True) for r in reps.values())
            out[case][method] = med
    return out


# -- the target ratios ------------------------------------------------------------------------------
def _ratio(
    combined: dict[str, Any],
    med: dict[str, Any],
    case: str,
    num: tuple[str, str],
    den: tuple[str, str],
    *,
    invert: bool = False,
) -> tuple[float, list[float], float, float] | None:
    """Ratio of medians num/den (den/num with invert), the per-round ratios, and both medians."""
    try:
        a = med[case][num[0]][num[1]]
        b = med[case][den[0]][den[1]]
    except KeyError:
        return None
    if not a or not b:
        return None
    per = []
    for rep, ra in combined[case][num[0]].items():
        rb = combined[case][den[0]].get(rep) or {}
        x, y = ra.get(num[1]), (1.0 if den[1] == "one" else rb.get(den[1]))
        if x and y:
            per.append(y / x if invert else x / y)
    return (b / a if invert else a / b), per, a, b


def ratios(combined: dict[str, Any], med: dict[str, Any], case_e: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(
        metric: str,
        case: str,
        num: tuple[str, str],
        den: tuple[str, str],
        op: str,
        target: float,
        *,
        invert: bool = False,
        info: bool = False,
        unit: str = "s",
    ) -> None:
        r = _ratio(combined, med, case, num, den, invert=invert)
        if r is None:
            return
        value, per, a, b = r
        ok = value <= target if op == "<=" else value >= target
        rows.append(
            {
                "metric": metric,
                "case": case,
                "value": value,
                "target": target,
                "op": op,
                "pass": ok,
                "info": info,
                "sk": a,
                "anchor": b,
                "unit": unit,
                "num": f"{num[0]}.{num[1]}",
                "den": f"{den[0]}.{den[1]}",
                "per_round": per,
                "spread": [min(per), max(per)] if per else None,
            }
        )

    cases = sorted(med, key=_case_order)
    for case in cases:
        kind = case.split("-")[0]
        if kind in ("a", "b"):
            add(
                "async stall / raw copy into reused buffers",
                case,
                ("sk_async", "stall_s"),
                ("raw_copy", "stall_s"),
                "<=",
                1.25,
            )
            add(
                "async stall / DCP async_save stall (reused stager)",
                case,
                ("sk_async", "stall_s"),
                ("dcp_async_reuse", "stall_s"),
                "<=",
                1.0,
            )
            add("sync save time / DCP save", case, ("sk_sync", "committed_s"), ("dcp_save", "committed_s"), "<=", 1.0)
            add(
                "sync save throughput / raw write+fsync",
                case,
                ("sk_sync", "committed_s"),
                ("raw_write", "committed_s"),
                ">=",
                0.8,
                invert=True,
            )
            add(
                "restore time / DCP load (same world size, cold cache)",
                case,
                ("sk_restore", "wall_s"),
                ("dcp_load", "wall_s"),
                "<=",
                1.0,
            )
            add(
                "peak RSS during restore / state size on the rank",
                case,
                ("sk_restore", "peak_rss_ratio"),
                ("sk_restore", "one"),
                "<=",
                1.1,
                unit="x",
            )
            add("digest cost / save time", case, ("digest", "wall_s"), ("sk_sync", "committed_s"), "<=", 0.1)
            # context, no target of their own
            add(
                "restore time / DCP load (warm cache)",
                case,
                ("sk_restore@warm", "wall_s"),
                ("dcp_load@warm", "wall_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "async stall / DCP async_save stall (default stager)",
                case,
                ("sk_async", "stall_s"),
                ("dcp_async", "stall_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "async time to committed / DCP async_save (reused stager)",
                case,
                ("sk_async", "committed_s"),
                ("dcp_async_reuse", "committed_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "sync save time / torch.save (+fsync)",
                case,
                ("sk_sync", "committed_s"),
                ("torch_save", "committed_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "restore time / torch.load (+copy in place)",
                case,
                ("sk_restore", "wall_s"),
                ("torch_load", "wall_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "restore time / raw read of the same bytes",
                case,
                ("sk_restore", "wall_s"),
                ("raw_read", "wall_s"),
                "<=",
                1.25,
                info=True,
            )
            add("save CPU seconds / DCP save", case, ("sk_sync", "cpu_s"), ("dcp_save", "cpu_s"), "<=", 1.0, info=True)
            add(
                "restore CPU seconds / DCP load",
                case,
                ("sk_restore", "cpu_s"),
                ("dcp_load", "cpu_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "DCP load: peak RSS / state size",
                case,
                ("dcp_load", "peak_rss_ratio"),
                ("dcp_load", "one"),
                "<=",
                1.1,
                unit="x",
                info=True,
            )
            add(
                "torch.load: peak RSS / state size",
                case,
                ("torch_load", "peak_rss_ratio"),
                ("torch_load", "one"),
                "<=",
                1.1,
                unit="x",
                info=True,
            )
        elif kind == "c":
            add(
                "restore time / DCP load (resharded 2 -> 3, cold cache)",
                case,
                ("sk_restore", "wall_s"),
                ("dcp_load", "wall_s"),
                "<=",
                1.0,
            )
            add(
                "bytes read / bytes needed (resharded 2 -> 3)",
                case,
                ("sk_restore", "sk_bytes_read"),
                ("sk_restore", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
            )
            add(
                "peak RSS during restore / state size on the rank (2 -> 3)",
                case,
                ("sk_restore", "peak_rss_ratio"),
                ("sk_restore", "one"),
                "<=",
                1.1,
                unit="x",
            )
            add(
                "restore time / DCP load (resharded 2 -> 3, warm cache)",
                case,
                ("sk_restore@warm", "wall_s"),
                ("dcp_load@warm", "wall_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "bytes read (syscalls, rchar) / needed (resharded 2 -> 3)",
                case,
                ("sk_restore", "bytes_read"),
                ("sk_restore", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
                info=True,
            )
            add(
                "DCP load: bytes read (rchar) / needed (2 -> 3)",
                case,
                ("dcp_load", "bytes_read"),
                ("dcp_load", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
                info=True,
            )
            add(
                "DCP load: peak RSS / state size (2 -> 3)",
                case,
                ("dcp_load", "peak_rss_ratio"),
                ("dcp_load", "one"),
                "<=",
                1.1,
                unit="x",
                info=True,
            )
        elif kind == "d":
            add(
                "bytes read / bytes needed (partial: one layer)",
                case,
                ("sk_partial", "sk_bytes_read"),
                ("sk_partial", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
            )
            add(
                "bytes read (syscalls, rchar) / needed (partial)",
                case,
                ("sk_partial", "bytes_read"),
                ("sk_partial", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
                info=True,
            )
            add(
                "partial restore time / DCP load of the layer's keys",
                case,
                ("sk_partial", "wall_s"),
                ("dcp_partial", "wall_s"),
                "<=",
                1.0,
                info=True,
            )
            add(
                "DCP load: bytes read (rchar) / needed (partial)",
                case,
                ("dcp_partial", "bytes_read"),
                ("dcp_partial", "bytes_needed"),
                "<=",
                1.05,
                unit="B",
                info=True,
            )
    if case_e is not None:
        described = case_e.get("described") if isinstance(case_e.get("described"), dict) else {}
        for src, key, metric, target in (
            (case_e, "commit_s", "manifest, 100,000 tensors from 8 ranks: commit time", 2.0),
            (case_e, "plan_s", "manifest, 100,000 tensors from 8 ranks: restore planning time", 2.0),
            (described, "commit_s", "described layout (format 7), 100,000 tensors from 8 ranks: commit time", 1.0),
            (
                described,
                "plan_s",
                "described layout (format 7), 100,000 tensors from 8 ranks: restore planning time",
                1.0,
            ),
        ):
            if src is described and not described:
                continue  # a case e result from before described layouts
            v = src.get(key)
            rows.append(
                {
                    "metric": metric,
                    "case": "e",
                    "value": v,
                    "target": target,
                    "op": "<=",
                    "pass": (v <= target) if isinstance(v, (int, float)) else None,
                    "info": False,
                    "sk": v,
                    "anchor": None,
                    "unit": "s (absolute)",
                    "num": key,
                    "den": None,
                    "per_round": [],
                    "spread": None,
                    "note": None if isinstance(v, (int, float)) else src.get("status", "not measured"),
                }
            )
    return rows


def add_unit_rows(med: dict[str, Any]) -> None:
    """``one``: a constant 1, so that absolute ratios (RSS) go through the same code."""
    for methods in med.values():
        for m in methods.values():
            m["one"] = 1.0


def _case_order(case: str) -> tuple[str, float]:
    kind, _, size = case.partition("-")
    try:
        return kind, float(size)
    except ValueError:
        return kind, 0.0


# -- markdown -----------------------------------------------------------------------------------
CASE_TITLES = {
    "a": "FSDP2, world size 2, {size} MiB per rank (params + AdamW state)",
    "b": "{n} small tensors (plain dict, world size 1)",
    "c": "resharded restore 2 -> 3 of the {size} MiB-per-rank FSDP2 checkpoint",
    "d": "partial restore of one layer (model/layers.3.*), {size} MiB per rank, world size 2",
    "e": "manifest with 100,000 tensors from 8 ranks",
}


def case_title(case: str, meta: dict[str, Any]) -> str:
    kind, _, size = case.partition("-")
    return CASE_TITLES.get(kind, case).format(size=size, n=f"{meta.get('n_tensors', 10_000):,}")


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if unit == "B" or (isinstance(v, (int, float)) and abs(v) >= 1e6):
        return f"{v / 2**20:,.1f} MiB"
    if unit == "x":
        return f"{v:.2f}x"
    if unit.startswith("s"):
        return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:.3g}"


def ratio_table(rows: list[dict[str, Any]], meta: dict[str, Any], *, info: bool) -> str:
    lines = [
        "| metric | case | shardkeeper | anchor | ratio (range over rounds) | target | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["info"] != info:
            continue
        if r["value"] is None:
            val = r.get("note") or "not measured"
            verdict = "-"
        else:
            unit = r["unit"]
            val = f"{r['value']:.3f}"
            if r["spread"]:
                val += f" ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})"
            verdict = "PASS" if r["pass"] else "MISS"
            if info:
                verdict = "(info)"
        unit = r["unit"]
        anchor = "-" if r["anchor"] is None or r["den"].endswith(".one") else _fmt(r["anchor"], unit)
        sk = _fmt(r["sk"], "x" if unit == "x" else unit)
        lines.append(
            f"| {r['metric']} | {r['case']} | {sk} | {anchor} | {val} | {r['op']} {r['target']:g} | {verdict} |"
        )
    return "\n".join(lines)


METHOD_ROWS = [
    ("raw_copy", "raw copy into reused buffer"),
    ("raw_write", "raw write + fsync"),
    ("torch_save", "torch.save (+fsync)"),
    ("dcp_save", "DCP save"),
    ("dcp_async", "DCP async_save (default)"),
    ("dcp_async_reuse", "DCP async_save (reused stager)"),
    ("sk_async", "shardkeeper save (async)"),
    ("sk_sync", "shardkeeper save (async_save=False)"),
    ("digest", "xxh3_128 over the state (alone)"),
    ("raw_read", "raw read"),
    ("torch_load", "torch.load + copy in place"),
    ("dcp_load", "DCP get_state_dict + load + set_state_dict"),
    ("sk_restore", "shardkeeper restore"),
    ("dcp_partial", "DCP load of the layer's keys"),
    ("sk_partial", "shardkeeper restore only=model/layers.3.*"),
]


def method_table(med: dict[str, Any], meta: dict[str, Any]) -> str:
    out = []
    for case in sorted(med, key=_case_order):
        out.append(f"**{case}: {case_title(case, meta)}**\n")
        out.append(
            "| method | stall | to committed / restore | warm restore | CPU s | read / needed | peak RSS / state | n |"
        )
        out.append("|---|---|---|---|---|---|---|---|")
        for m, label in METHOD_ROWS:
            v = med[case].get(m)
            if v is None:
                continue
            warm = med[case].get(m + "@warm", {})
            t = v.get("committed_s", v.get("wall_s"))
            read = v.get("sk_bytes_read", v.get("bytes_read"))
            need = v.get("bytes_needed")
            rn = f"{read / need:.3f}" if read and need else "-"
            if m == "digest":
                rn = "-"
            out.append(
                f"| {label} | {_fmt(v.get('stall_s'), 's')} | {_fmt(t, 's')} | {_fmt(warm.get('wall_s'), 's')} "
                f"| {v.get('cpu_s', 0):.2f} | {rn} | {_fmt(v.get('peak_rss_ratio'), 'x')} | {v['n']} |"
            )
        out.append("")
    return "\n".join(out)


def _core_desc(mach: dict[str, Any]) -> str:
    c = mach.get("core_source") or {}
    if c.get("mode") in (None, "installed"):
        return "the installed shardkeeper-core"
    return f"{c['mode']} {c.get('rev', '?')} (sources sha256 {c.get('sources_sha256', '?')})"


def markdown(results: dict[str, Any]) -> str:
    mach = results["machine"]
    meta = results.get("meta", {})
    fails = [r for r in results["ratios"] if not r["info"] and r["pass"] is False]
    lines = [
        f"# shardkeeper benchmark, {results['date']}",
        "",
        f"Command: `{results['command']}`; wall time {results['wall_s'] / 60:.1f} min.",
        "",
        f"Machine: {mach['cpu_model']}, {mach['cores']} cores, {mach['ram_bytes'] / 2**30:.0f} GiB RAM, "
        f"{mach['disk']['fs']} on {mach['disk']['device']} (work dir {mach['disk']['workdir']}), "
        f"torch {mach['torch']}, Python {mach['python']}, shardkeeper {mach['shardkeeper_git']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in mach['load_avg_at_start'])}. "
        f"Core measured: {_core_desc(mach)}.",
        "",
        "How: " + " ".join(results["notes"]),
        "",
        *(
            [
                f"**Errors in this run** (samples a launch wrote before failing are kept): "
                f"{'; '.join(results['errors'])}",
                "",
            ]
            if results.get("errors")
            else []
        ),
        "## Targets",
        "",
        ratio_table(results["ratios"], meta, info=False),
        "",
        f"{sum(1 for r in results['ratios'] if not r['info'] and r['pass'])} PASS, {len(fails)} MISS, "
        f"{sum(1 for r in results['ratios'] if not r['info'] and r['pass'] is None)} not measured.",
        "",
        "## Context (no target of their own)",
        "",
        ratio_table(results["ratios"], meta, info=True),
        "",
        "## Medians per case and method",
        "",
        method_table(results["medians"], meta),
    ]
    unverified = [
        f"{c}/{m}" for c, ms in results["medians"].items() for m, v in ms.items() if v.get("verified") is False
    ]
    if unverified:
        lines += ["", f"**Restored state differs from the saved state in: {', '.join(unverified)}**"]
    return "\n".join(lines) + "\n"


# -- chart --------------------------------------------------------------------------------------
def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["ratios"] if not r["info"] and isinstance(r["value"], (int, float))]
    if not rows:
        return
    # normalized so that <= 1 meets the target whatever its direction
    norm = [(r["value"] / r["target"]) if r["op"] == "<=" else (r["target"] / r["value"]) for r in rows]
    labels = [f"{r['metric']} [{r['case']}]" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.38 * len(rows) + 1.6))
    y = list(range(len(rows)))[::-1]
    colors = ["#2e7d32" if r["pass"] else "#c62828" for r in rows]
    ax.barh(y, norm, color=colors, height=0.6)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    for yi, r, n in zip(y, rows, norm):
        ax.text(n * 1.03, yi, f"{r['value']:.3g} (target {r['op']} {r['target']:g})", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(min(0.02, min(norm) / 2), max(4.0, max(norm) * 3))
    ax.set_xlabel("value / target (for >= targets: target / value); left of the dashed line meets the target")
    ax.set_title(f"shardkeeper vs anchors, {results['date']} (green: PASS, red: MISS)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -- README ---------------------------------------------------------------------------------------
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def readme_section(results: dict[str, Any], md_rel: str, png_rel: str, json_rel: str) -> str:
    mach = results["machine"]
    return "\n".join(
        [
            START,
            f"Latest run: {results['date']}, `{results['command']}` (through nox: "
            f"`python3 -m nox -s bench{' -- ' + results['command'].split(' ', 2)[2] if results['command'].count(' ') >= 2 else ''}`), "
            f"{results['wall_s'] / 60:.0f} min on {mach['cores']} cores ({mach['cpu_model']}), "
            f"{mach['ram_bytes'] / 2**30:.0f} GiB RAM, {mach['disk']['fs']} disk, torch {mach['torch']}, CPU only; "
            f"core: {_core_desc(mach)}. "
            "Medians over rounds; cold page cache for restores (every file dropped with "
            "POSIX_FADV_DONTNEED after fsync). Full tables: "
            f"[{md_rel}]({md_rel}); raw samples: [{json_rel}]({json_rel}).",
            "",
            ratio_table(results["ratios"], results.get("meta", {}), info=False),
            "",
            f"![ratios vs targets]({png_rel})",
            END,
        ]
    )


def update_readme(readme: Path, section: str) -> None:
    text = readme.read_text()
    if START in text and END in text:
        text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    else:
        m = re.search(r"^## Benchmarks[ \t]*\n", text, flags=re.M)
        if m is None:
            text = text.rstrip("\n") + "\n\n## Benchmarks\n\n" + section + "\n"
        else:
            nxt = re.search(r"^## ", text[m.end() :], flags=re.M)
            end = m.end() + nxt.start() if nxt else len(text)
            tail = text[end:]
            text = text[: m.end()] + "\n" + section + "\n" + ("\n" + tail if tail else "")
    readme.write_text(text)
