"""Checkpoint-interval advisor: how often to save, from measured save costs and an MTBF.

Torch-free. Every commit records the save's timings in the manifest's metadata
(``metadata.timings``, docs/format.md 3.4): the slowest rank's ``stall_s`` (training blocked)
and ``write_s`` (background write), the coordinator's ``commit_s`` and ``save_s`` (its write
plus commit: how long after the stall the step became durable), and ``sync``. The advisor
reads the recent ones and applies

- Young (1974): ``T = sqrt(2 C M)``, first order, for ``C << M``;
- Daly (2006), higher order: ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C``
  for ``C < 2M``, else ``T = M``;

where ``C`` is the time training loses per checkpoint (the stall of an async save; stall +
write + commit of a synchronous one) and ``M`` the mean time between failures. ``T`` is the
compute time between checkpoints.

Expected work lost per failure (failures uniform in time): a checkpoint started at ``t`` is
durable at ``t + W``, so with an async save a failure loses ``T/2 + W`` on average (``(T + C)/2``
for a synchronous one), plus the restart time ``R`` when given.

MTBF: given by the caller, or estimated from the job's own restart history
(``mtbf_from_restarts(restarts, elapsed_s)``: elapsed wall time / restarts, e.g. from the
scheduler or torchrun's ``TORCHELASTIC_RESTART_COUNT`` and the job's start time). The
``created_at`` gaps of a root's steps are NOT failures and are never used as such.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float) -> float:
    """``"3h"`` -> 10800, ``"30m"``, ``"90s"``, ``"1d12h"``, ``"250ms"``, ``42`` (seconds)."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().replace(" ", "")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if not m or m.end() == pos:
            break
        total += float(m.group(1)) * _SECONDS[(m.group(2) or "").lower()]
        pos = m.end()
    if not s or pos != len(s):
        raise ValueError(f"cannot read the duration {text!r}; write e.g. 3h, 30m, 90s, 1d12h or seconds")
    return total


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)``."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (compute time between checkpoints)."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def expected_lost_work(
    interval_s: float, *, cost_s: float, durable_s: float, sync: bool, restart_s: float = 0.0
) -> float:
    """Mean work lost per failure: ``T/2 + W + R`` (async), ``(T + C)/2 + R`` (synchronous)."""
    if sync:
        return (interval_s + cost_s) / 2.0 + restart_s
    return interval_s / 2.0 + durable_s + restart_s


def waste_fraction(interval_s: float, *, cost_s: float, lost_s: float, mtbf_s: float) -> float:
    """First-order share of wall time lost: checkpoint cost per interval plus rework per failure."""
    return cost_s / (interval_s + cost_s) + lost_s / mtbf_s


def mtbf_from_restarts(restarts: int, elapsed_s: float) -> float:
    """MTBF from the job's restart history: elapsed wall time / failures (restarts)."""
    if restarts < 1:
        raise ValueError(
            f"{restarts} restarts: no failure seen yet, so the history gives only a lower bound "
            f"(MTBF > {elapsed_s:.0f} s); pass an MTBF instead"
        )
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be > 0, got {elapsed_s}")
    return elapsed_s / restarts


def _check(cost_s: float, mtbf_s: float) -> None:
    if not (cost_s >= 0 and mtbf_s > 0 and math.isfinite(cost_s) and math.isfinite(mtbf_s)):
        raise ValueError(f"need cost >= 0 and MTBF > 0 (seconds), got cost {cost_s}, MTBF {mtbf_s}")


@dataclass(frozen=True)
class SaveSample:
    """One committed save's recorded timings."""

    step: int
    stall_s: float
    write_s: float
    commit_s: float
    save_s: float
    sync: bool
    created_at: str = ""


@dataclass
class Advice:
    """The advisor's answer; ``summary()`` for people, ``to_json()`` for tools and logs."""

    mtbf_s: float
    cost_s: float  # training time lost per checkpoint (C)
    durable_s: float  # from the end of the stall until the step is committed (W)
    sync: bool
    young_s: float
    daly_s: float
    recommended_s: float
    lost_work_s: float  # per failure, at the recommended interval
    waste: float  # share of wall time, at the recommended interval
    samples: int = 0
    interval_s: float | None = None  # the current interval, when given
    interval_lost_work_s: float | None = None
    interval_waste: float | None = None
    seconds_per_step: float | None = None
    recommended_steps: int | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = [
            f"MTBF {_fmt(self.mtbf_s)}; per checkpoint: training blocked {_fmt(self.cost_s)} (C), "
            f"durable {_fmt(self.durable_s)} later (W), {'synchronous' if self.sync else 'async'} "
            f"saves; from {self.samples} recorded save(s)"
            if self.samples
            else f"MTBF {_fmt(self.mtbf_s)}; per checkpoint: C {_fmt(self.cost_s)}, W {_fmt(self.durable_s)}",
            f"Young interval {_fmt(self.young_s)}; Daly interval {_fmt(self.daly_s)}",
            f"recommended: save every {_fmt(self.recommended_s)}"
            + (
                f" (~{self.recommended_steps} steps at {self.seconds_per_step:.3g} s/step)"
                if self.recommended_steps
                else ""
            )
            + f"; expected lost work per failure {_fmt(self.lost_work_s)}; {100 * self.waste:.2f}% of wall time lost",
        ]
        if self.interval_s is not None and self.interval_lost_work_s is not None and self.interval_waste is not None:
            lines.append(
                f"current interval {_fmt(self.interval_s)}: expected lost work per failure "
                f"{_fmt(self.interval_lost_work_s)}; {100 * self.interval_waste:.2f}% of wall time lost"
            )
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _fmt(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def recent_samples(storage: Any, last: int = 10) -> list[SaveSample]:
    """Timings of the newest ``last`` committed steps that recorded them (oldest first)."""
    from shardkeeper.core.commit.committed import committed_steps, load_manifest
    from shardkeeper.core.errors import CheckpointError

    out: list[SaveSample] = []
    for step in reversed(committed_steps(storage)):
        if len(out) >= last:
            break
        try:
            m = load_manifest(storage, step)
        except CheckpointError:
            continue
        sample = sample_of(step, m.metadata, m.created_at)
        if sample is not None:
            out.append(sample)
    return out[::-1]


def sample_of(step: int, metadata: Mapping[str, Any], created_at: str = "") -> SaveSample | None:
    """The timings a step's manifest metadata recorded (``metadata.timings``), or None."""
    t: Any = metadata.get("timings")
    if not isinstance(t, dict):
        return None
    try:
        return SaveSample(
            step,
            float(t["stall_s"]),
            float(t["write_s"]),
            float(t.get("commit_s", 0.0)),
            float(t["save_s"] if "save_s" in t else t["write_s"]),
            bool(t.get("sync", False)),
            created_at,
        )
    except (KeyError, TypeError, ValueError):
        return None


def _seconds_per_step(samples: Sequence[SaveSample]) -> float | None:
    """Wall time per training step between the first and last sample, when they span >= 60 s
    (created_at has 1 s resolution): a rate, not a failure statistic."""
    if len(samples) < 2:
        return None
    try:
        t0 = datetime.fromisoformat(samples[0].created_at)
        t1 = datetime.fromisoformat(samples[-1].created_at)
    except ValueError:
        return None
    span, steps = (t1 - t0).total_seconds(), samples[-1].step - samples[0].step
    if span < 60 or steps <= 0:
        return None
    return span / steps


def advise(
    samples: Sequence[SaveSample] = (),
    *,
    mtbf_s: float,
    interval_s: float | None = None,
    cost_s: float | None = None,
    durable_s: float | None = None,
    sync: bool | None = None,
    restart_s: float = 0.0,
) -> Advice:
    """Advice from recorded samples (medians: robust to a slow first save) or given costs."""
    if not samples and cost_s is None:
        raise ValueError("no recorded save timings: pass cost_s (and durable_s) or samples")
    is_sync = sync if sync is not None else (bool(samples) and samples[-1].sync)
    if samples:
        stall = statistics.median(s.stall_s for s in samples)
        durable = statistics.median(s.save_s for s in samples)
    else:
        stall, durable = float(cost_s or 0.0), float(durable_s or 0.0)
    c = cost_s if cost_s is not None else (stall + durable if is_sync else stall)
    w = durable_s if durable_s is not None else durable
    young, daly = young_interval(c, mtbf_s), daly_interval(c, mtbf_s)
    warnings: list[str] = []
    rec = daly
    if not is_sync and w > rec:
        warnings.append(
            f"the background write takes {_fmt(w)}, longer than the optimal interval {_fmt(daly)}: "
            f"a save every {_fmt(daly)} would wait for the previous one; recommending {_fmt(w)} "
            f"(speed up the writes: more io_threads / max_files_per_rank, a faster store)"
        )
        rec = w
    if c >= mtbf_s / 2:
        warnings.append(f"a checkpoint costs {_fmt(c)}, more than half the MTBF: checkpointing cannot save much here")
    lost = expected_lost_work(rec, cost_s=c, durable_s=w, sync=is_sync, restart_s=restart_s)
    sps = _seconds_per_step(samples)
    adv = Advice(
        mtbf_s=mtbf_s,
        cost_s=c,
        durable_s=w,
        sync=is_sync,
        young_s=young,
        daly_s=daly,
        recommended_s=rec,
        lost_work_s=lost,
        waste=waste_fraction(rec, cost_s=c, lost_s=lost, mtbf_s=mtbf_s),
        samples=len(samples),
        seconds_per_step=sps,
        recommended_steps=max(1, round(rec / sps)) if sps else None,
        warnings=warnings,
    )
    if interval_s is not None:
        if interval_s <= 0:
            raise ValueError(f"interval must be > 0, got {interval_s}")
        extra = max(0.0, w - interval_s) if not is_sync else 0.0  # each save waits for the last
        c_now = c + extra
        lost_now = expected_lost_work(interval_s, cost_s=c_now, durable_s=w, sync=is_sync, restart_s=restart_s)
        adv.interval_s, adv.interval_lost_work_s = interval_s, lost_now
        adv.interval_waste = waste_fraction(interval_s, cost_s=c_now, lost_s=lost_now, mtbf_s=mtbf_s)
        if extra:
            warnings.append(
                f"at the current interval {_fmt(interval_s)} the background write ({_fmt(w)}) does not "
                f"finish before the next save: each save blocks training {_fmt(extra)} longer"
            )
    return adv


def advise_root(
    root: Any,
    *,
    mtbf_s: float,
    interval_s: float | None = None,
    last: int = 10,
    restart_s: float = 0.0,
    storage_options: Mapping[str, Any] | None = None,
) -> Advice:
    """``advise`` on the timings recorded under ``root`` (a path, URL or Storage); an adapter
    can log ``advise_root(...).summary()`` at start."""
    from shardkeeper.core.storage import open_storage

    storage = open_storage(root, **dict(storage_options or {}))
    samples = recent_samples(storage, last)
    if not samples:
        raise ValueError(
            f"no save timings recorded under {storage.url} (steps written by shardkeeper-core "
            f"before the advisor, or none committed); pass the costs yourself (--cost, --durable)"
        )
    return advise(samples, mtbf_s=mtbf_s, interval_s=interval_s, restart_s=restart_s)


__all__ = [
    "Advice",
    "SaveSample",
    "advise",
    "advise_root",
    "daly_interval",
    "expected_lost_work",
    "mtbf_from_restarts",
    "parse_duration",
    "recent_samples",
    "sample_of",
    "waste_fraction",
    "young_interval",
]
