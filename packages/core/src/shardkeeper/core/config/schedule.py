"""The options that decide when to save and which steps are kept as the best: their checks.

``save_every_steps`` / ``save_every_s`` (seconds, or ``"advised"``: the interval advisor's
Young/Daly interval, which needs ``mtbf_s``) drive ``CheckpointManager.should_save``
(``manager/schedule.py``); ``keep_best=(n, metric, mode)`` is a retention rule
(``lifecycle/best.py``). Every error names the option, the value and the remedy. Torch-free.
"""

from __future__ import annotations

import math
from typing import Any, Literal

BestMode = Literal["min", "max"]
KeepBest = tuple[int, str, BestMode]
"""``(n, metric, mode)``: keep the n committed steps with the lowest (``"min"``) or highest
(``"max"``) ``metadata[metric]``."""
ADVISED = "advised"

_KEEP_BEST_FORM = (
    "pass keep_best=(n, metric, mode), e.g. (3, 'val_loss', 'min'): keep the n committed steps with the "
    "lowest ('min') or highest ('max') number saved as save(step, state, metadata={metric: value})"
)


def check_keep_best(value: Any, name: str = "keep_best") -> KeepBest | None:
    """``value`` as an ``(n, metric, mode)`` tuple (a list is taken too), or None; a
    ``TypeError`` / ``ValueError`` naming ``name``, the value and the form it takes."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"{name}={value!r} is not a triple; {_KEEP_BEST_FORM}")
    n, metric, mode = value
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name}={value!r}: n must be an int >= 1, not {type(n).__name__}; {_KEEP_BEST_FORM}")
    if n < 1:
        raise ValueError(f"{name}={value!r}: n must be >= 1 (to keep no best step, pass keep_best=None)")
    if not isinstance(metric, str) or not metric:
        raise TypeError(
            f"{name}={value!r}: metric must be the name of a metadata key, got {metric!r}; {_KEEP_BEST_FORM}"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"{name}={value!r}: mode must be 'min' (lower is better) or 'max', got {mode!r}")
    return (n, metric, mode)


def _positive(name: str, value: float | None, takes: str) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r}; {name} takes {takes}")


def check_schedule(save_every_steps: int | None, save_every_s: float | str | None, mtbf_s: float | None) -> list[str]:
    """The schedule options (their types already checked): ranges and combinations. Raises
    ``ValueError`` where the schedule is ambiguous or incomplete; returns what to warn about
    (a setting that has no effect)."""
    if save_every_steps is not None and save_every_steps < 1:
        raise ValueError(
            f"save_every_steps={save_every_steps}; pass an int >= 1 (save at every step divisible by it), "
            f"or None (no step schedule)"
        )
    if save_every_s != ADVISED:
        _positive("save_every_s", save_every_s, "seconds > 0 (a finite number), 'advised' or None")  # type: ignore[arg-type]
    _positive("mtbf_s", mtbf_s, "the job's mean time between failures in seconds (> 0, finite), or None")
    if save_every_steps is not None and save_every_s is not None:
        raise ValueError(
            f"save_every_steps={save_every_steps} and save_every_s={save_every_s!r}: should_save() follows "
            f"one schedule; pass one of them (every N steps, or every T seconds / 'advised')"
        )
    if save_every_s == ADVISED and mtbf_s is None:
        raise ValueError(
            "save_every_s='advised' without mtbf_s: the Young/Daly interval needs the job's mean time "
            "between failures; pass mtbf_s (seconds, e.g. mtbf_s=6 * 3600), or a fixed save_every_s"
        )
    if mtbf_s is not None and save_every_s != ADVISED:
        return [
            f"mtbf_s={mtbf_s} without save_every_s='advised': only the advised interval uses the mean "
            f"time between failures; set save_every_s='advised' or drop mtbf_s"
        ]
    return []


__all__ = ["ADVISED", "BestMode", "KeepBest", "check_keep_best", "check_schedule"]
