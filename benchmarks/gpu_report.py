"""benchmarks/gpu.py's verdicts and its Markdown report, from the results document it builds."""

from __future__ import annotations

from typing import Any

#: shardkeeper's methods in benchmarks/loop.py (each staging mode with the thread and the process
#: writer): all held to the stall target; the loop-overhead targets are overlapped staging's (blocking staging copies on the compute stream while the
#: GPU waits, so its overhead is about one raw copy by construction: reported, not judged).
SK_METHODS = ("sk_blocking", "sk_overlap", "sk_process", "sk_process_overlap")
OVERHEAD_JUDGED = ("sk_overlap", "sk_process_overlap")
STALL_MAX = 1.1  # x the raw device-to-host copy
OVERHEAD_MAX = 0.25  # x the raw device-to-host copy
RSS_GROWTH_MAX = 0.01  # x the state, over the saves after the first


def _row(part: str, what: str, value: Any, target: str, ok: bool | None) -> dict[str, Any]:
    return {"part": part, "what": what, "value": value, "target": target, "pass": ok}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: the measured value and PASS (True), MISS (False) or None (not run)."""
    rows: list[dict[str, Any]] = []
    t = res.get("tests", {})
    tests = t.get("tests", [])
    if "tests" not in res:
        pass
    elif res.get("dry_run"):
        rows.append(_row("tests", "CUDA tests collected", len(tests), "> 0", bool(tests) and t.get("rc") == 0))
    else:
        bad = [x["name"] for x in tests if x["outcome"] in ("failed", "error")]
        ran = [x for x in tests if x["outcome"] == "passed"]
        ok = bool(tests) and not bad and t.get("rc") == 0
        rows.append(_row("tests", "CUDA tests passed", f"{len(ran)}/{len(tests)}", "all, none failed", ok))
    for size, part in res.get("loop", {}).items():
        methods, info = part.get("methods"), part.get("info")
        if not methods or not info:
            rows.append(_row(f"loop {size} GiB", "ran", part.get("rc"), "exit 0 with results", False))
            continue
        raw = info["raw_copy_s"]
        dcp = {m: r["overhead_s"] for m, r in methods.items() if m.startswith("dcp")}
        for m in SK_METHODS:
            r = methods.get(m)
            if r is None:
                continue
            stall = r["stall_s"] / raw if raw else None
            rows.append(_row(f"loop {size} GiB", f"{m} stall / raw D2H", stall, f"<= {STALL_MAX}",
                             stall is not None and stall <= STALL_MAX))  # fmt: skip
            over = r.get("overhead_per_raw_copy")
            judged = m in OVERHEAD_JUDGED
            rows.append(_row(f"loop {size} GiB", f"{m} loop overhead / raw D2H", over,
                             f"<= {OVERHEAD_MAX}" if judged else "reported",
                             (over is not None and over <= OVERHEAD_MAX) if judged else None))  # fmt: skip
            below = all(r["overhead_s"] < v for v in dcp.values()) if dcp else None
            rows.append(_row(f"loop {size} GiB", f"{m} loop overhead below every DCP variant",
                             {k: round(v, 4) for k, v in dcp.items()} | {m: round(r["overhead_s"], 4)},
                             "yes" if judged else "reported", below if judged else None))  # fmt: skip
    mem = res.get("memory", {}).get("result")
    if "memory" not in res:
        pass
    elif mem is None:
        rows.append(_row("memory", "ran", res.get("memory", {}).get("rc"), "exit 0 with results", False))
    else:
        for m, v in mem["methods"].items():
            g = v["growth"]
            judged = m.startswith("sk_")
            if g.get("pinned_allocator_bytes") is not None:
                rows.append(_row("memory", f"{m} pinned-allocator growth (bytes)", g["pinned_allocator_bytes"], "0",
                                 g["pinned_allocator_bytes"] == 0 if judged else None))  # fmt: skip
            limit = RSS_GROWTH_MAX * mem["state_bytes"]
            rows.append(_row("memory", f"{m} RSS growth (bytes)", g["rss_bytes"], f"< {limit:.0f}",
                             (g["rss_bytes"] is not None and g["rss_bytes"] < limit) if judged else None))  # fmt: skip
            last = v["samples"][-1]
            if "pinned_how" in last:
                rows.append(_row("memory", f"{m} staging buffer (bytes, pinned how)",
                                 f"{last['staging_buffer_bytes']} ({last['pinned_how']})", "info", None))  # fmt: skip
    rows += _logical_rows(res)
    if res.get("dry_run"):  # CPU figures: the parts ran, their speeds say nothing about CUDA
        for r in rows:
            if r["part"] != "tests" and r["what"] != "ran":
                r["pass"] = None
    return rows


def _logical_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Part 4: per case, the device's sums equal the host definition's (judged), its time per
    GiB, per raw copy and the numpy path's (reported), its peak extra device memory."""
    if "logical" not in res:
        return []
    got = res["logical"].get("result")
    if got is None:
        return [_row("logical", "ran", res["logical"].get("rc"), "exit 0 with results", False)]
    rows = []
    for name, c in got["cases"].items():
        rows.append(_row("logical", f"{name}: device sums equal the host definition's", c["equal"], "yes", c["equal"]))
        rows.append(_row("logical", f"{name}: device s/GiB", c["device_s_per_gib"], "reported", None))
        rows.append(_row("logical", f"{name}: device / raw D2H", c["device_per_raw_copy"], "reported", None))
        rows.append(_row("logical", f"{name}: host numpy s/GiB", c["host_numpy_s_per_gib"], "reported", None))
        if c.get("peak_extra_device_bytes") is not None:
            mib = c["peak_extra_device_bytes"] / (1 << 20)
            rows.append(_row("logical", f"{name}: peak extra device MiB", mib, "reported", None))
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    title = "dry run on CPU: no CUDA figure" if res.get("dry_run") else env.get("gpu", "?")
    lines = [
        f"# The CUDA paths ({res['started']}, {title})",
        "",
        f"`{res['command']}` in {res.get('seconds', 0):.0f} s: torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
        f"Python {env.get('python')}, {env.get('cpus')} CPUs; checkpoints under {res.get('workdir')}.",
        "",
        "| part | what | value | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in res.get("targets", []):
        verdict = {True: "PASS", False: "MISS", None: ""}[r["pass"]]
        lines.append(f"| {r['part']} | {r['what']} | {_fmt(r['value'])} | {r['target']} | {verdict} |")
    tests = res.get("tests", {}).get("tests", [])
    failed = [x for x in tests if x["outcome"] in ("failed", "error")]
    if failed:
        lines += ["", "## Failed tests", ""]
        lines += [f"- `{x['name']}`: {x['message'][:400]}" for x in failed]
    for size, part in res.get("loop", {}).items():
        if part.get("methods"):
            i = part["info"]
            lines += [
                "",
                f"## Loop, {size} GiB: d={i['dim']}, {i['layers']} blocks, {i['steps']} steps, batch {i['batch']} x "
                f"seq {i['seq']}; raw D2H copy {i['raw_copy_s'] * 1e3:.1f} ms",
                "",
                "| method | K-step loop (s) | overhead (s) | paired per round (s) | / raw copy | save() blocked (s) "
                "| waited after the steps (s) |",
                "|---|---|---|---|---|---|---|",
            ]
            for m, r in part["methods"].items():
                per, paired = r.get("overhead_per_raw_copy"), r.get("overhead_paired_s")
                lines.append(
                    f"| {m} | {r['loop_s']:.3f} | {r['overhead_s']:.4f} | {_fmt(paired)} | {_fmt(per)} | "
                    f"{r['stall_s']:.4f} | {_fmt(r.get('tail_s', ''))} |"
                )
            if part.get("partial"):
                lines += ["", "(cut short: the rounds that finished)"]
        elif part:
            lines += [
                "",
                f"## Loop, {size} GiB: did not finish (exit {part.get('rc')})",
                "",
                "```",
                part["tail"][-2000:],
                "```",
            ]
    mem = res.get("memory", {})
    if mem and "result" not in mem:
        lines += [
            "",
            f"## Host memory: did not finish (exit {mem.get('rc')})",
            "",
            "```",
            mem.get("tail", "")[-2000:],
            "```",
        ]
    lines.append("")
    return "\n".join(lines)


__all__ = ["markdown", "targets"]
