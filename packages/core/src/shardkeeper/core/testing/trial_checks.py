"""What the kill -9 campaign (``campaign``) saves and how its checks report.

The state of a step is a function of the step (``deterministic_state``), so a check restores
the newest step and compares it bit for bit. Every check records what it finds in the
``Summary`` and none raises (``checked``): damage is what the campaign exists to report, so
a verify, restore, listing or gc that fails on it is a failure of the trial, named with the
trial, its kill point and the step, and the campaign goes on.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def deterministic_state(step: int, tensor_bytes: int = 1 << 20) -> dict[str, Any]:
    """The state saved at ``step``: a few float32 tensors of about ``tensor_bytes`` in all."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    n = max(1, tensor_bytes // 4)
    sizes = [n // 2, n // 4, n - n // 2 - n // 4]
    return {
        "model": {f"layer{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(sizes)},
        "step": step,
    }


def blank_like(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state of ``state``'s shapes, zeroed, to restore into."""
    return {"model": {k: v.new_zeros(v.shape) for k, v in state["model"].items()}, "step": -1}


@dataclass
class Summary:
    root: str
    seed: int
    trials: int = 0
    killed: int = 0
    completed: int = 0
    points: Counter[str] = field(default_factory=Counter)
    points_hit: Counter[str] = field(default_factory=Counter)
    commits_acknowledged: int = 0
    steps_verified: int = 0
    restores_bit_exact: int = 0
    leftovers_removed: int = 0
    incomplete_uploads_aborted: int = 0
    failures: list[str] = field(default_factory=list)  # what was lost or damaged
    writer_errors: list[str] = field(default_factory=list)  # writers that failed, not by the kill
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "seed": self.seed,
            "trials": self.trials,
            "killed": self.killed,
            "completed_without_kill": self.completed,
            "kill_points_drawn": dict(sorted(self.points.items())),
            "kill_points_hit": dict(sorted(self.points_hit.items())),
            "commits_acknowledged": self.commits_acknowledged,
            "steps_verified": self.steps_verified,
            "restores_bit_exact": self.restores_bit_exact,
            "leftovers_removed": self.leftovers_removed,
            "incomplete_uploads_aborted": self.incomplete_uploads_aborted,
            "lost_or_damaged": len(self.failures),
            "failures": self.failures,
            "writer_errors": self.writer_errors,
            "seconds": round(self.seconds, 2),
        }


def checked(s: Summary, where: str, what: str, check: Callable[[], T], default: T) -> T:
    """``check()``; when it raises, ``default``, with ``"<where>: <what>: <error>"`` recorded
    as a failure (an interrupt still ends the campaign)."""
    try:
        return check()
    except Exception as e:
        s.failures.append(f"{where}: {what}: {type(e).__name__}: {e}")
        return default


def verify_all(storage: Any, committed: list[int], where: str, s: Summary) -> None:
    """Every committed step verifies clean; each one that does not is a failure."""
    from shardkeeper.core.verify.step import verify_step

    for c in committed:
        s.steps_verified += 1
        rep = checked(s, where, f"step {c} could not be verified", functools.partial(verify_step, storage, c), None)
        if rep is not None and not rep.ok:
            s.failures.append(f"{where}: step {c} does not verify: {[str(p) for p in rep.problems]}")


def check_persistent(storage: Any, where: str, s: Summary) -> None:
    """The persistent tier behind a killed local one: what is committed verifies, and gc
    removes the rest of an upload the kill cut short."""
    from shardkeeper.core.commit.committed import committed_steps, step_dirs
    from shardkeeper.core.lifecycle.gc import collect_garbage

    where = f"{where}, the persistent tier"
    committed = checked(s, where, "its committed steps could not be listed", lambda: committed_steps(storage), None)
    if committed is None:
        return
    verify_all(storage, committed, where, s)
    report = checked(
        s, where, "gc failed", lambda: collect_garbage(storage, min_age_s=0.0, no_running_saves=True), None
    )
    if report is not None:
        s.leftovers_removed += len(report.removed_paths)
    after = checked(s, where, "its steps could not be listed after gc", lambda: committed_steps(storage), None)
    dirs = checked(s, where, "its step directories could not be listed", lambda: step_dirs(storage), None)
    kept = checked(s, where, "its steps' references could not be read", lambda: pointed_at(storage, committed), None)
    if after is not None and dirs is not None and kept is not None and (after != committed or set(dirs) - set(committed) - kept):  # fmt: skip
        s.failures.append(f"{where}: gc changed the committed steps or left uncommitted directories")


def pointed_at(storage: Any, committed: list[int]) -> set[int]:
    """The steps whose files ``committed`` steps point at (incremental saves): their
    directories stay, without a manifest once their own step is deleted."""
    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.commit.files import referenced_paths
    from shardkeeper.core.format.layout import parse_step_dir

    paths = {p for c in committed for p in referenced_paths(c, load_manifest(storage, c))}
    return {s for p in paths if (s := parse_step_dir(p.split("/", 1)[0])) is not None}


__all__ = ["Summary", "blank_like", "check_persistent", "checked", "deterministic_state", "pointed_at", "verify_all"]
