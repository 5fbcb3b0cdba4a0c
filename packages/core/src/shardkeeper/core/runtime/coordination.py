"""What the save and restore paths ask of the ranks' coordination: the ``Coordinator`` protocol (torch-free)."""

from __future__ import annotations

from typing import Protocol

from shardkeeper.core.commit.protocol import Failure, Outcome, RankReport, Report
from shardkeeper.core.commit.terms import SaveTerms


class Coordinator(Protocol):
    rank: int
    world_size: int

    def report(self, seq: int, report: Report, *, terms: SaveTerms | None = None) -> None:
        """Every rank but the coordinator: send this rank's report (or its failure); a group
        leader, its group's folded report. ``terms``: the save's, sent with it."""
        ...

    def leads(self) -> bool:
        """Whether this rank folds a group's reports (a world above ``group_ranks``)."""
        ...

    def collect_group(
        self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure | None:
        """A group leader: its group's other ranks' reports, in rank order, or None for a
        failure in its group (the failing rank tells the coordinator itself). The coordinator
        is a group of its own: none. Raises ``SaveTermsMismatch`` when a report's terms
        differ from ``terms``."""
        ...

    def collect(
        self, seq: int, own: RankReport, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure:
        """Coordinator only: its own report and every other rank's, in rank order; fails fast
        on a failure report (then returns that one). Raises ``SaveTermsMismatch`` when a
        report's terms differ from ``terms``."""
        ...

    def publish(self, seq: int, outcome: Outcome, *, terms: SaveTerms | None = None) -> None:
        """Coordinator only: the save's outcome, for every other rank, with its ``terms``."""
        ...

    def outcome(self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None) -> Outcome:
        """Every rank but the coordinator: wait for the outcome the coordinator publishes; a
        commit of other terms than ``terms`` raises ``SaveTermsMismatch``."""
        ...

    def agree_int(self, value: int, op: str) -> int:
        """Caller's thread only: ``max``/``min`` of ``value`` over ranks, or rank 0's (``bcast``)."""
        ...

    def agree_text(self, text: str) -> str:
        """Caller's thread only: rank 0's ``text`` on every rank (an error's reason)."""
        ...


__all__ = ["Coordinator"]
