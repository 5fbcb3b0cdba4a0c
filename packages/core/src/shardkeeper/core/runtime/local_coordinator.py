"""The coordinator of a manager alone in its process (no process group, or ``process_group=
"local"``): it is the only rank, so it commits what it wrote and agrees with itself."""

from __future__ import annotations

from shardkeeper.core.commit.protocol import Failure, Outcome, RankReport, Report
from shardkeeper.core.commit.terms import SaveTerms


class LocalCoordinator:
    """One process, no process group."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self._outcomes: dict[int, Outcome] = {}

    def report(self, seq: int, report: Report, *, terms: SaveTerms | None = None) -> None:
        raise AssertionError("the only rank is the coordinator; it does not report to itself")

    def leads(self) -> bool:
        return False

    def collect_group(
        self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure | None:
        return []

    def collect(
        self, seq: int, own: RankReport, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure:
        return [own]

    def publish(self, seq: int, outcome: Outcome, *, terms: SaveTerms | None = None) -> None:
        self._outcomes[seq] = outcome

    def outcome(self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None) -> Outcome:
        return self._outcomes.pop(seq)

    def agree_int(self, value: int, op: str) -> int:
        return value

    def agree_text(self, text: str) -> str:
        return text


__all__ = ["LocalCoordinator"]
