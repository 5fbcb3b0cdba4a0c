"""The best committed steps by a metric saved in their metadata: retention's ``keep_best``.

``keep_best=(n, metric, mode)`` keeps the n committed steps with the lowest (``"min"``) or
highest (``"max"``) ``metadata[metric]``, the number a save recorded with
``save(step, state, metadata={metric: value})``. The metric is read from the manifests that
retention loads anyway (``retention.apply_retention``): no read of its own. A step without
the metric (or with a value that is not a finite number) is never among the best; a warning
says so once per root and metric. Ties go to the older step: a later one must be strictly
better to displace it. Torch-free.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from shardkeeper.core.config.schedule import KeepBest


class MissingMetricWarning(UserWarning):
    """Committed steps lack the metric that ``keep_best`` ranks by: they are not kept as best."""


_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def metric_value(metadata: Mapping[str, Any], metric: str) -> float | None:
    """``metadata[metric]`` as a finite number, or None (absent, a bool, text, nan, ...)."""
    value = metadata.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def best_steps(
    keep_best: KeepBest, steps: Iterable[int], metadata: Mapping[int, Mapping[str, Any]], where: str = ""
) -> set[int]:
    """The ``n`` best of ``steps`` by ``metadata[step][metric]`` (``keep_best``); a step
    missing from ``metadata`` (its manifest could not be read) or without the metric is not
    among them, with one ``MissingMetricWarning`` per ``where`` (the root) and metric."""
    n, metric, mode = keep_best
    scored: list[tuple[float, int]] = []
    missing: list[int] = []
    for step in sorted(set(steps)):
        value = metric_value(metadata.get(step, {}), metric)
        if value is None:
            missing.append(step)
        else:
            scored.append((value if mode == "min" else -value, step))  # ties: the older step first
    if missing:
        _warn_once(where, metric, missing)
    return {step for _, step in sorted(scored)[:n]}


def _warn_once(where: str, metric: str, steps: list[int]) -> None:
    with _lock:
        if (where, metric) in _warned:
            return
        _warned.add((where, metric))
    shown = ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")
    root = f" under {where}" if where else ""
    warnings.warn(
        f"keep_best: step(s) {shown}{root} have no number {metric!r} in their metadata, so they are not "
        f"counted among the best (retention may delete them); record it with "
        f"save(step, state, metadata={{{metric!r}: value}}) (warned once per root and metric)",
        MissingMetricWarning,
        stacklevel=2,
    )


__all__ = ["MissingMetricWarning", "best_steps", "metric_value"]
