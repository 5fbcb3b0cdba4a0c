"""What a save's background thread gets from the caller's: the ``SaveJob`` (its plan, staged
spans and metadata) and the ``Start`` signal, and how long a rank waits for the outcome."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.save.deferred import DeferredCopy
from shardkeeper.core.save.plan import SavePlan, WriteItem
from shardkeeper.core.save.stage import Span


class Start:
    """The caller's go-ahead to a save's background thread, with the stall ``save()`` measured:
    writer threads compete for the GIL, so they start once the caller's own work is done."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._stall_s = 0.0

    def give(self, stall_s: float) -> None:
        self._stall_s = stall_s
        self._event.set()

    def wait(self) -> float:
        self._event.wait()
        return self._stall_s


@dataclass(frozen=True)
class SaveJob:
    """One save as its background thread gets it."""

    step: int
    seq: int
    """The save's number in this manager's sequence: the keys its ranks meet under."""
    attempt: str
    plan: SavePlan
    groups: list[list[WriteItem]]
    spans: list[list[Span]]
    objects: dict[str, Any]
    extended: bool
    metadata: dict[str, Any]
    sync: bool
    """A synchronous save (``async_save=False``): written from the caller's tensors."""
    retention: RetentionPolicy
    start: Start
    deferred: DeferredCopy | None = None
    staged: threading.Event | None = None
    """Set once ``deferred`` is copied (``staging="overlap"``); optimizer steps wait for it."""
    replicas: dict[str, Any] | None = None
    """The sums of the replicated copies this rank holds and does not write (save/replicas.py)."""


def outcome_timeout(commit_timeout_s: float) -> float:
    """How long a rank waits for the outcome: the coordinator always publishes one, at the
    latest when its own wait for the reports times out, so longer than that."""
    return 2 * commit_timeout_s + 30.0


__all__ = ["SaveJob", "Start", "outcome_timeout"]
