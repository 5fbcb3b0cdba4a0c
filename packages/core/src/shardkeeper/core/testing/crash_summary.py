"""What a crash trial (``crash_trial``) found: each trial's result, the summary of a run (JSON),
and the runs as a markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

_AFTER = {"all": "every rank's save()", "own": "its own save()"}
_TIMINGS = ("save_launch_s", "restore_launch_s", "latest_wait_s", "persist_exit_s", "trial_s")


@dataclass
class TrialResult:
    index: int
    victim: int
    step: int
    returned_everywhere: bool = False
    committed_at_save_exit: bool = False
    latest: list[Any] = field(default_factory=list)  # each rank's latest_step()
    committed_restored: bool = False
    persist_pids: list[int] = field(default_factory=list)
    persist_left: list[int] = field(default_factory=list)
    locks_left: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    save_launch_s: float = 0.0
    restore_launch_s: float = 0.0
    latest_wait_s: float = 0.0
    persist_exit_s: float = 0.0
    trial_s: float = 0.0


@dataclass
class CrashSummary:
    ranks: int
    writer: str
    seed: int
    tensor_bytes: int
    kill_after: str = "all"
    results: list[TrialResult] = field(default_factory=list)
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    seconds: float = 0.0

    @property
    def failures(self) -> list[str]:
        return [f for r in self.results for f in r.failures]

    def to_json(self) -> dict[str, Any]:
        rs = self.results
        return {
            "ranks": self.ranks,
            "writer": self.writer,
            "kill_after": self.kill_after,
            "seed": self.seed,
            "tensor_bytes_per_rank": self.tensor_bytes,
            "trials": len(rs),
            "committed_restored": sum(r.committed_restored for r in rs),
            "lost": sum(r.returned_everywhere and not r.committed_restored for r in rs),
            "not_returned_everywhere": sum(not r.returned_everywhere for r in rs),
            "committed_restored_by_step": _by_step(rs),
            "committed_at_save_exit": sum(r.committed_at_save_exit for r in rs),
            "persist_processes_left": sum(len(r.persist_left) for r in rs),
            "lock_files_left": sum(len(r.locks_left) for r in rs),
            "failures": self.failures,
            "timings_s": {k: _spread([getattr(r, k) for r in rs]) for k in _TIMINGS},
            "load_average_before": list(self.load_before),
            "load_average_after": list(self.load_after),
            "seconds": round(self.seconds, 1),
            "per_trial": [asdict(r) for r in rs],
        }


def _by_step(rs: list[TrialResult]) -> dict[str, str]:
    """For each killed save's step: trials committed and restored / trials."""
    steps = sorted({r.step for r in rs})
    return {
        str(k): f"{sum(r.committed_restored for r in rs if r.step == k)}/{sum(r.step == k for r in rs)}" for k in steps
    }


def _spread(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def to_markdown(summaries: Sequence[CrashSummary]) -> str:
    """One row per run: what committed and restored, what was lost or left, and the timings."""
    rows = [
        "| ranks | writer | victim killed after | trials | committed + restored bit-exact | by killed step | lost | not returned everywhere "
        "| persist processes left | lock files left | save launch s | restore launch s | latest_step() wait s "
        "| persist exit s | failures |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    for s in summaries:
        js = s.to_json()
        t = js["timings_s"]
        cell = [f"{t[k]['median']} ({t[k]['min']}-{t[k]['max']})" if t[k] else "-" for k in _TIMINGS[:4]]
        rows.append(
            f"| {s.ranks} | {s.writer} | {_AFTER[s.kill_after]} | {js['trials']} | {js['committed_restored']}/{js['trials']} "
            f"| {', '.join(f'{k}: {v}' for k, v in js['committed_restored_by_step'].items())} | {js['lost']} "
            f"| {js['not_returned_everywhere']} | {js['persist_processes_left']} | {js['lock_files_left']} "
            f"| {' | '.join(cell)} | {len(js['failures'])} |"
        )
    return "\n".join(rows) + "\n\nTimings: median (min-max) over the trials.\n"


__all__ = ["CrashSummary", "TrialResult", "to_markdown"]
