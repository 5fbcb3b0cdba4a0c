"""``CheckpointManager.should_save(step)``: whether to save at ``step``, the same answer on
every rank (a rank that saved alone would hang the collective save).

The options (``config/schedule.py``) give one schedule:

- ``save_every_steps=N``: every step divisible by N. Step numbers alone decide, the same on
  every rank: no communication.
- ``save_every_s=T``: once T seconds have passed since the last True (or since the first
  call), by rank 0's clock alone; the other ranks' clocks are never read.
- ``save_every_s="advised"`` with ``mtbf_s``: T is the interval advisor's recommendation
  (Young/Daly, ``tools/advisor.py``) from the timings recorded in the root's newest committed
  steps (up to 10), which rank 0 reads again after each save. With none recorded yet (a new
  root), the first call is True: that save measures the cost.

How a time schedule agrees: rank 0 times every call and measures the seconds per step (the
median of the last 32 calls' gaps). At a *check* every rank calls ``agree`` (a broadcast of
rank 0's decision): save now or not, and in how many steps the next check comes, half the
steps left to the deadline at the measured pace (at least 1). Between checks the answer is
False on every rank without any communication, so ranks decide from step numbers only after
they agreed on them: about log2(T / step time) + 2 checks per interval, each one small
broadcast. The pace is the slower of the calls' median gap and the pace since the previous
check, so a slowdown shortens the next wait at once; only one of more than twofold within a
single wait makes that save late. A call at or below the newest step this manager saved or
restored is False (a save there would be refused). Call ``should_save`` on every rank with
the same steps (every step, or every k-th), on the caller's thread.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from shardkeeper.core.commit.committed import load_manifest, manifest_steps
from shardkeeper.core.config.arguments import check_step
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.config.schedule import ADVISED
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.storage import Storage
from shardkeeper.core.tools.advisor import SaveSample, advise, sample_of

log = logging.getLogger(__name__)

RATE_WINDOW = 32
"""Calls whose gaps give the seconds per step (their median)."""
ADVICE_SAMPLES = 10
"""The newest committed steps whose timings the advised interval is computed from."""
_MAX_WAIT = 1 << 40
_FAILED = -1


class RecordedTimings:
    """The save timings of the newest committed steps of a root (``metadata.timings``), each
    manifest read once: a step seen before costs nothing but the listing."""

    def __init__(self, storage: Callable[[], Storage], last: int = ADVICE_SAMPLES) -> None:
        self._storage, self._last = storage, last
        self._seen: dict[int, SaveSample | None] = {}

    def __call__(self) -> list[SaveSample]:
        """Oldest first; raises the storage's error (``CheckpointError``)."""
        storage = self._storage()
        out: list[SaveSample] = []
        for step in reversed(manifest_steps(storage)):
            if len(out) >= self._last:
                break
            if step not in self._seen:
                try:
                    m = load_manifest(storage, step)
                except CheckpointError:  # damaged, or deleted since the listing: no sample
                    self._seen[step] = None
                    continue
                self._seen[step] = sample_of(step, m.metadata, m.created_at)
            sample = self._seen[step]
            if sample is not None:
                out.append(sample)
        return out[::-1]


class SaveSchedule:
    """The answers of ``should_save`` under one manager's options. ``agree``: rank 0's int on
    every rank (a collective); ``timings``: the root's recorded save timings, read on rank 0
    for ``save_every_s="advised"``; ``clock``: seconds, read on rank 0 only."""

    def __init__(
        self,
        options: CheckpointOptions,
        *,
        rank: int,
        agree: Callable[[int], int],
        timings: Callable[[], list[SaveSample]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        where: str = "",
    ) -> None:
        self.every_steps = options.save_every_steps
        self.every_s = options.save_every_s
        self.mtbf_s = options.mtbf_s
        self.rank, self.where = rank, where
        self._agree, self._timings, self.clock = agree, timings, clock
        self.last: int | None = None
        """The newest step this manager saved or restored (the same on every rank)."""
        self.next_check: int | None = None
        # rank 0 alone:
        self._calls: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW + 1)
        self._checked: tuple[int, float] | None = None  # the last check: step, time
        self._origin: float | None = None  # when the interval running now began
        self._advised_s: float | None = None
        self._stale = True  # advised: read the timings again at the next check
        self._measuring: int | None = None  # advised: the step of the save made to measure its cost

    @property
    def active(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    def mark(self, step: int) -> None:
        """``step`` was saved or restored (on every rank alike)."""
        if self.last is None or step > self.last:
            self.last = step
        self._stale = True

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step`` (a collective at the checks of a time schedule)."""
        step = check_step("should_save", step)
        if not self.active:
            raise ValueError(
                f"should_save(): no save schedule {self.where}; pass save_every_steps=N (every N steps), "
                f"save_every_s=T (every T seconds) or save_every_s='advised' with mtbf_s=... to the "
                f"CheckpointManager (or to the adapter, which passes them on)"
            )
        if self.every_steps is not None:
            return step % self.every_steps == 0 and (self.last is None or step > self.last)
        if self.rank == 0:
            self._calls.append((step, self.clock()))
        if self.next_check is not None and step < self.next_check:
            return False
        failure: Exception | None = None
        value = 0
        if self.rank == 0:
            try:  # never raise before the collective: the other ranks would wait in it
                value = self._decide(step)
            except Exception as e:  # noqa: BLE001 - raised on rank 0 once every rank knows
                failure, value = e, _FAILED
        value = self._agree(value)
        if failure is not None:
            raise failure
        if value == _FAILED:
            raise CheckpointError(f"should_save({step}): rank 0 could not decide (its error says why) {self.where}")
        self.next_check = step + max(1, value >> 1)
        return bool(value & 1)

    # -- rank 0 ------------------------------------------------------------------------------
    def _decide(self, step: int) -> int:
        """``2 * steps to the next check + (1 if save now)``."""
        now = self._calls[-1][1]
        if self._origin is None:
            self._origin = now
        if self.last is not None and step <= self.last:
            return 2  # a save here would be refused: look again at the next step
        interval = self._interval()
        rate = self._seconds_per_step(step, now)
        if interval is None:  # advised, with no timings recorded yet
            if self._measuring is None:
                self._measuring = step
                return self._save(now, step, None, rate)
            return 2 * min(_MAX_WAIT, max(1, step - self._measuring))  # until they appear
        left = interval - (now - self._origin)
        if rate is None:  # the first call: no pace yet
            return self._save(now, step, interval, rate) if left <= 0 else 2
        steps_left = left / rate
        if steps_left <= 0.5:  # nearer now than the next step
            return self._save(now, step, interval, rate)
        return 2 * min(_MAX_WAIT, max(1, math.floor(steps_left / 2)))

    def _save(self, now: float, step: int, interval: float | None, rate: float | None) -> int:
        self._origin = now
        wait = 1 if interval is None or rate is None else max(1, math.floor(interval / rate / 2))
        log.debug("should_save(%d): save; next check in %d step(s) %s", step, wait, self.where)
        return 2 * min(_MAX_WAIT, wait) + 1

    def _seconds_per_step(self, step: int, now: float) -> float | None:
        """The slower of two paces: the median gap of the last calls, and the pace since the
        previous check (which follows a slowdown at once, where the median lags)."""
        calls = list(self._calls)
        paces = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(calls, calls[1:]) if s1 > s0]
        previous, self._checked = self._checked, (step, now)
        if not paces:
            return None
        pace = statistics.median(paces)
        if previous is not None and step > previous[0]:
            pace = max(pace, (now - previous[1]) / (step - previous[0]))
        return max(pace, 1e-9)

    def _interval(self) -> float | None:
        if self.every_s != ADVISED:
            return float(self.every_s)  # type: ignore[arg-type]
        if self._stale and self._timings is not None:
            try:
                samples = self._timings()
            except CheckpointError as e:
                log.warning(
                    "should_save: the save timings %s could not be read (%s); the interval stays", self.where, e
                )
                samples = []
            if samples:
                assert self.mtbf_s is not None  # (the options refuse "advised" without it)
                self._advised_s = advise(samples, mtbf_s=self.mtbf_s).recommended_s
                # the newest save's timings are in once its step is: until then, read again
                self._stale = self.last is not None and samples[-1].step < self.last
        return self._advised_s


__all__ = ["RecordedTimings", "SaveSchedule"]
