"""What verifying a checkpoint found: problems, per step and per root (``verify/checks.py`` checks).

A problem names the step, the key, the file, the byte range, and what was expected against
what was found; ``to_json`` is the form ``shardkeeper verify --json`` prints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import CorruptCheckpointError, KeyNotHeldError

#: At most this many problems of one kind are listed per file; the rest are counted.
MAX_PROBLEMS_PER_FILE = 10


def rng(a: int, b: int) -> str:
    """A byte range as messages write it."""
    return f"[{a}, {b})"


def problem_kind(e: BaseException | None, damage: str) -> str:
    """The kind of a failed read: ``key`` for a file sealed under a key the key given does not
    hold (not damage: a key rotated out, see ``shardkeeper keys``), ``damage`` for other damage,
    ``read`` when the storage did not answer (which proves nothing)."""
    if isinstance(e, KeyNotHeldError):
        return "key"
    return damage if isinstance(e, CorruptCheckpointError) else "read"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint. ``start``/``end`` are byte offsets in ``file``."""

    step: int | None
    kind: str  # manifest, unsupported-format, missing-file, size, range, length, digests,
    #            digest, tiling, header, read, path, dtype, encoding, truncated-list, key (a key the
    #            key given does not hold: not damage), logical (``verify --logical``: verify/logical.py);
    #            a warning's: replicas, elsewhere (``VerifyReport.warnings``)
    message: str
    key: str = ""
    file: str = ""
    start: int | None = None
    end: int | None = None
    expected: str = ""
    found: str = ""

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "key": self.key,
            "file": self.file,
            "start": self.start,
            "end": self.end,
            "expected": self.expected,
            "found": self.found,
            "message": self.message,
        }


@dataclass
class LogicalTally:
    """What ``verify --logical`` made of a step's tensor and bytes leaves (verify/logical.py)."""

    checked: int = 0  # their digest recomputed from the stored chunks and compared
    not_recorded: int = 0  # the save recorded no digest (``logical_check="off"``, an older writer)
    not_checked: int = 0  # recorded, but a chunk is damaged or unread (said as such), or no byte was read
    algorithm: str = ""  # the manifest's digest algorithm, when this version does not know it

    def __str__(self) -> str:
        parts = [f"{self.checked} checked"]
        if self.not_recorded:
            parts.append(f"{self.not_recorded} not recorded")
        if self.not_checked:
            why = f" (algorithm {self.algorithm!r}, unknown to this version)" if self.algorithm else ""
            parts.append(f"{self.not_checked} not checked{why}")
        return "logical digests: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "not_recorded": self.not_recorded,
            "not_checked": self.not_checked,
            "algorithm": self.algorithm or None,
        }


@dataclass
class VerifyReport:
    """The result of verifying one committed step."""

    step: int
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0  # wall time of the check
    files_read: set[str] = field(default_factory=set)  # files some chunk's bytes were checked in
    structure_only: bool = False  # encrypted, read without the key: no byte was checked
    logical: LogicalTally | None = None  # ``verify --logical`` only
    #: what is not damage but a user should know (kind ``replicas``: committed although
    #: replicas disagreed, under ``logical_check="warn"``); the step is ``ok`` with them
    warnings: list[Problem] = field(default_factory=list)
    #: ``here_only`` (a node's directory of a local tier): the step's files not in it, unchecked
    elsewhere: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ok": self.ok,
            "files_checked": self.files_checked,
            "chunks_checked": self.chunks_checked,
            "bytes_checked": self.bytes_checked,
            "structure_only": self.structure_only,
            "seconds": round(self.seconds, 3),
            **({"logical": self.logical.to_json()} if self.logical is not None else {}),
            "problems": [p.to_json() for p in self.problems],
            "warnings": [p.to_json() for p in self.warnings],
            **({"elsewhere": list(self.elsewhere)} if self.elsewhere else {}),
        }


@dataclass
class RootVerifyReport:
    """The result of verifying every committed step under a root, plus root-level problems
    (a manifest that does not validate, one of a newer format)."""

    root: str
    steps: list[VerifyReport] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.steps)

    @property
    def all_problems(self) -> list[Problem]:
        out = list(self.problems)
        for r in self.steps:
            out.extend(r.problems)
        return out

    @property
    def all_warnings(self) -> list[Problem]:
        return [w for r in self.steps for w in r.warnings]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "ok": self.ok,
            "steps": [r.to_json() for r in self.steps],
            "problems": [p.to_json() for p in self.problems],
        }


class Collector:
    """Adds problems to a report, capping repeats of one kind in one file."""

    def __init__(self, report: VerifyReport, where: str) -> None:
        self.report = report
        self.where = where
        self.counts: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, message: str, **kw: Any) -> None:
        k = (kw.get("file", ""), kind)
        self.counts[k] += 1
        if self.counts[k] <= MAX_PROBLEMS_PER_FILE:
            self.report.problems.append(Problem(step=self.report.step, kind=kind, message=message, **kw))

    def finish(self) -> None:
        for (file, kind), n in sorted(self.counts.items()):
            if n > MAX_PROBLEMS_PER_FILE:
                more = n - MAX_PROBLEMS_PER_FILE
                self.report.problems.append(
                    Problem(
                        step=self.report.step,
                        kind="truncated-list",
                        file=file,
                        message=f"step {self.report.step}: {more} more {kind} problem(s) in "
                        f"{file or self.where} not listed",
                    )
                )


__all__ = [
    "MAX_PROBLEMS_PER_FILE",
    "Collector",
    "LogicalTally",
    "Problem",
    "RootVerifyReport",
    "VerifyReport",
    "problem_kind",
    "rng",
]
