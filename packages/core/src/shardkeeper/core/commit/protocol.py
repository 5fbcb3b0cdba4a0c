"""The commit protocol: who calls what, in which order, and the typed records ranks exchange.

A save, on every rank of the process group (``save/runner.py``; the coordinator is rank 0):

1. Caller's thread, every rank: ``SaveRunner.refusal`` (one stat: a step already committed
   is refused before anything is written), then ``SaveRunner.prepare`` (flatten, plan,
   stage; no communication). An asynchronous ``save()`` returns here. Every rank numbers
   its saves alike (``seq``), so the ranks of one save meet under the same store keys.
2. Background thread, every rank: ``SaveRunner.run`` writes this rank's shard files, giving
   a ``RankReport``, or a ``Failure`` of phase ``stage`` or ``write``. A refused save takes
   its number and its turn too (``run_refused``): a ``Failure`` of phase ``check``, so no
   rank waits for it until the timeout.
3. Ranks > 0: ``Coordinator.report(seq, report)``, then ``Coordinator.outcome(seq)``, which
   waits longer than the coordinator waits for reports: every rank hears the verdict.
4. Rank 0: ``Coordinator.collect(seq, own)`` (every report in rank order, or the first
   ``Failure``), merge (``commit/merge.py``), ``put_manifest.commit_manifest``, then
   ``Coordinator.publish(seq, outcome)``: ``COMMITTED``, or an ``Outcome`` holding the
   ``Failure`` of the failing rank or of the commit itself (phase ``commit``).
5. Every rank: its own failure first, else the outcome's, is the save's error (a synchronous
   ``save()`` returns here). Rank 0 applies retention after a commit, never before.

At a world above ``commit_group_ranks`` (group commit, ``save/group.py``), rank 0 is a
group of its own and ranks 1, 2, ... form groups of ``commit_group_ranks``; a group's ranks
report to its leader (its first rank), and leaders first ``collect_group``, write the group's
page and fold the reports into one (``RankReport.group``), which they report as in 3 (rank 0
keeps its own): step 4 merges one report per group.

A restore (``restore/restorer.py``), every rank, on the caller's thread (collectives): rank 0's
candidate steps are broadcast (``agree_int(.., "bcast")``); after each attempt the ranks
agree on the worst ``Verdict`` (``agree_int(.., "max")``): ``RESTORED`` returns that step,
``DAMAGED`` falls back to the next candidate, ``FATAL`` raises. ``delete()``: rank 0
deletes and broadcasts a ``Deletion``.

Reports and outcomes cross the c10d store as JSON objects (``to_json``/``from_json``;
``runtime/coordinator.py`` sends them). Their member names and order are the wire format:
``ok`` first, then the record's fields. A message that is not such a record is refused with
``ProtocolError`` naming the step, the rank, the store key and the member (the checks of
members: ``commit/members.py``). Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardkeeper.core.commit.members import as_object, describe_value, malformed, member
from shardkeeper.core.errors import ProtocolError
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.jsonvalue import EXTENDED_MEMBER
from shardkeeper.core.format.reports import report_for_wire

#: The rank that merges the reports and commits.
COORDINATOR = 0


class Phase(str, enum.Enum):
    """Where a save failed."""

    CHECK = "check"  # refused before anything was written (the step is already committed)
    STAGE = "stage"  # the deferred copy of optimizer-owned tensors (staging="overlap")
    WRITE = "write"  # this rank's shard files
    REPLICATE = "replicate"  # the node-local tier: sending this rank's files to its peers, or taking theirs
    COMMIT = "commit"  # the coordinator's merge, checks and put of the manifest

    def __str__(self) -> str:  # in messages: "write", not "Phase.WRITE"
        return self.value


class Verdict(enum.IntEnum):
    """One rank's result of one restore attempt, ordered by severity: the ranks agree on the
    largest (one all_reduce max)."""

    RESTORED = 0
    DAMAGED = 1  # the step is damaged or gone since listed: fall back to the previous one
    FATAL = 2  # an error no other step fixes (storage, state mismatch): raise


class Deletion(enum.IntEnum):
    """The coordinator's result of ``delete()``, broadcast to every rank."""

    FAILED = -1  # raised on every rank
    KEPT = 0  # still committed (the newest step is never deleted)
    GONE = 1


@dataclass(frozen=True)
class Failure:
    """A failed save as every rank hears it: the failing rank, the phase, the path and the
    error (``"Type: message"``). ``conflict``: another writer committed the step first."""

    ok: ClassVar[bool] = False
    rank: int
    phase: Phase
    path: str
    error: str
    conflict: bool = False

    @classmethod
    def of(cls, rank: int, phase: Phase, path: str, error: BaseException, *, conflict: bool = False) -> Failure:
        return cls(rank, phase, path, f"{type(error).__name__}: {error}", conflict)

    def to_json(self) -> dict[str, Any]:
        """``conflict`` is a member of commit failures only (as the wire has it)."""
        doc: dict[str, Any] = {
            "ok": False,
            "rank": self.rank,
            "phase": self.phase.value,
            "path": self.path,
            "error": self.error,
        }
        if self.phase is Phase.COMMIT:
            doc["conflict"] = self.conflict
        return doc

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> Failure:
        d = as_object(doc, where)
        if d.get("ok") is not False:
            raise malformed(where, f"member 'ok' is {describe_value(d.get('ok'))}, not false")
        phase = member(d, "phase", "str", where)
        if phase not in {p.value for p in Phase}:
            raise malformed(where, f"phase {phase!r} is none of {', '.join(p.value for p in Phase)}")
        conflict = member(d, "conflict", "bool", where) if "conflict" in d else False
        return cls(
            member(d, "rank", "int", where),
            Phase(phase),
            member(d, "path", "str", where),
            member(d, "error", "str", where),
            conflict,
        )


@dataclass(frozen=True)
class Timings:
    """A rank's share of one save, for the interval advisor (manifest metadata ``timings``)."""

    stall_s: float = 0.0  # the caller's wait in save()
    write_s: float = 0.0  # this rank's background write
    sync: bool = False  # a synchronous save (async_save=False)

    def to_json(self) -> dict[str, Any]:
        return {"stall_s": self.stall_s, "write_s": self.write_s, "sync": self.sync}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> Timings:
        d = as_object(doc, where)
        return cls(
            float(member(d, "stall_s", "number", where)),
            float(member(d, "write_s", "number", where)),
            member(d, "sync", "bool", where),
        )


@dataclass(frozen=True)
class RankReport:
    """What one rank wrote for a save, for the coordinator to merge (``commit/merge.py`` reads it
    by these member names; ``docs/protocol.md``, "Commit")."""

    ok: ClassVar[bool] = True
    rank: int
    attempt: str
    declared: dict[str, list[Any]]
    """Key -> [kind, dtype, global shape]: every leaf on the coordinator, per-rank ones elsewhere."""
    declared_digest: str
    """``assemble.declared_digest`` of this rank's shared declarations."""
    chunks: dict[str, Any]
    """The chunk records as a table (``format/table.py``: ``keys``, ``counts``, ``table``);
    the writer's table stays an object in memory and is encoded only on the wire."""
    files: dict[str, dict[str, Any]]
    objects: dict[str, Any]
    bases: list[int]
    """The committed step whose manifest this save's references come from (incremental)."""
    extended: bool
    """The report holds values of extended JSON (NaN, big integers): parse it exactly."""
    per_rank_prefixes: list[str]
    layouts: list[str]
    timings: Timings = field(default_factory=Timings)
    described: dict[str, Any] = field(default_factory=dict)
    """Described leaves (format.md 3.8): ``digest`` of which and how, this rank's ``index``
    file (``[path, size, digest]``, or None) and the ``chunk_files`` its rows name; {}: none."""
    ranks: list[list[int]] = field(default_factory=list)
    """The ranks this report stands for, as ``[first, last]`` runs, when a group leader folded
    the equal reports of several ranks into one (``save/group.py``); []: ``rank`` alone."""
    group: dict[str, Any] = field(default_factory=dict)
    """A group leader's report (a save at a world above ``commit_group_ranks``): ``count``
    (its group's ranks, from ``rank`` on), ``page`` (``[path, size, digest, files, bytes]``
    of the page holding their records; None: a save without described leaves) and ``others`` (the reports of its ranks that differ
    from this one, each with its ``ranks``) and ``refs`` (``[path, end]`` of the files of
    earlier steps their index rows reference); {}: a rank's own report."""

    def members(self) -> dict[str, Any]:
        """The report by its wire member names, ``chunks`` as held (the coordinator's own
        report is merged from memory, never encoded)."""
        return {
            "ok": True,
            "rank": self.rank,
            "attempt": self.attempt,
            "declared": self.declared,
            "declared_digest": self.declared_digest,
            "chunks": self.chunks,
            "files": self.files,
            "objects": self.objects,
            "bases": self.bases,
            EXTENDED_MEMBER: self.extended,
            "per_rank_prefixes": self.per_rank_prefixes,
            "layouts": self.layouts,
            "timings": self.timings.to_json(),
            # only with described leaves: other reports keep the bytes they always had
            **({"described": self.described} if self.described else {}),
            **({"ranks": self.ranks} if self.ranks else {}),
            **({"group": self.group} if self.group else {}),
        }

    def to_json(self) -> dict[str, Any]:
        """The report as sent: chunks as columns (the coordinator decodes 100,000 chunks of a
        rank in tens of milliseconds)."""
        doc = self.members()
        if isinstance(self.chunks.get("table"), ChunkTable):
            doc["chunks"] = report_for_wire(self.chunks)
        if self.group:
            doc["group"] = {**self.group, "others": [o.to_json() for o in self.group["others"]]}
        return doc

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> RankReport:
        d = as_object(doc, where)
        if d.get("ok") is not True:
            raise malformed(where, f"member 'ok' is {describe_value(d.get('ok'))}, not true")
        declared = member(d, "declared", "object", where)
        for key, decl in declared.items():
            if not (isinstance(decl, list) and len(decl) == 3):
                raise malformed(
                    where, f"the declaration of {key!r} is {describe_value(decl)}, not [kind, dtype, shape]"
                )
        chunks = member(d, "chunks", "object", where)
        for name, kind in (("keys", "list[str]"), ("counts", "list[int]"), ("table", "object")):
            member(chunks, name, kind, f"{where}, member 'chunks'")
        files = member(d, "files", "object", where)
        for rel, info in files.items():
            if not isinstance(info, dict):
                raise malformed(where, f"the record of file {rel!r} is {describe_value(info)}, not an object")
        return cls(
            rank=member(d, "rank", "int", where),
            attempt=member(d, "attempt", "str", where),
            declared=declared,
            declared_digest=member(d, "declared_digest", "str", where),
            chunks=chunks,
            files=files,
            objects=member(d, "objects", "object", where),
            bases=member(d, "bases", "list[int]", where),
            extended=member(d, EXTENDED_MEMBER, "bool", where),
            per_rank_prefixes=member(d, "per_rank_prefixes", "list[str]", where),
            layouts=member(d, "layouts", "list[str]", where),
            timings=Timings.from_json(member(d, "timings", "object", where), where=f"{where}, member 'timings'"),
            described=_described(d.get("described", {}), where),
            ranks=_ranks(d.get("ranks", []), where),
            group=_group(d.get("group", {}), where),
        )


def _ranks(doc: object, where: str) -> list[list[int]]:
    if not isinstance(doc, list) or not all(
        isinstance(e, list) and len(e) == 2 and type(e[0]) is int and type(e[1]) is int and e[0] <= e[1] for e in doc
    ):
        raise malformed(where, f"member 'ranks' is {describe_value(doc)}, not a list of [first, last] runs")
    return doc


def _group(doc: object, where: str) -> dict[str, Any]:
    """A leader's ``group`` member, checked for its shape; its ``others`` parsed as reports."""
    d = as_object(doc, f"{where}, member 'group'")
    if not d:
        return {}
    w = f"{where}, member 'group'"
    member(d, "count", "int", w)
    page = d.get("page")
    if page is not None and not (
        isinstance(page, list)
        and len(page) == 5
        and isinstance(page[0], str)
        and isinstance(page[2], str)
        and all(type(page[i]) is int and page[i] >= 0 for i in (1, 3, 4))
    ):
        raise malformed(w, f"the page entry is {describe_value(page)}, not [path, size, digest, files, bytes]")
    others = [RankReport.from_json(o, where=f"{w}, one of 'others'") for o in member(d, "others", "list", w)]
    refs = member(d, "refs", "list", w)
    if not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int for e in refs):
        raise malformed(w, "its refs are not [path, end] pairs")
    return {"count": d["count"], "page": page, "others": others, "refs": refs}


def _described(doc: object, where: str) -> dict[str, Any]:
    """A report's ``described`` member, checked for its shape."""
    d = as_object(doc, f"{where}, member 'described'")
    if not d:
        return {}
    w = f"{where}, member 'described'"
    member(d, "digest", "str", w)
    files = member(d, "chunk_files", "list", w)
    if not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int for e in files):
        raise malformed(where, "the chunk_files of 'described' are not [path, end] pairs")
    entry = d.get("index")
    if entry is not None and not (
        isinstance(entry, list)
        and len(entry) == 3
        and isinstance(entry[0], str)
        and type(entry[1]) is int
        and isinstance(entry[2], str)
    ):
        raise malformed(where, f"the index entry is {describe_value(entry)}, not [path, size, digest]")
    return dict(d)


Report = RankReport | Failure


def report_from_json(doc: object, *, rank: int, where: str) -> Report:
    """The report of ``rank`` as the coordinator reads it from the store: a ``RankReport`` or a
    ``Failure``, sent by that rank (``where`` names the step and the store key)."""
    d = as_object(doc, where)
    ok = d.get("ok")
    if not isinstance(ok, bool):
        raise malformed(where, f"member 'ok' is {describe_value(ok)}, not true or false")
    report: Report = RankReport.from_json(d, where=where) if ok else Failure.from_json(d, where=where)
    if report.rank != rank:
        raise malformed(where, f"it says it is from rank {report.rank}, its key is rank {rank}'s")
    return report


@dataclass(frozen=True)
class Outcome:
    """The coordinator's verdict on one save: committed (``failure`` None), or the failure."""

    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "rank": COORDINATOR} if self.failure is None else self.failure.to_json()

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> Outcome:
        d = as_object(doc, where)
        ok = d.get("ok")
        if ok is True:
            return COMMITTED
        if ok is False:
            return cls(Failure.from_json(d, where=where))
        raise malformed(where, f"member 'ok' is {describe_value(ok)}, not true or false")


COMMITTED = Outcome()


__all__ = [
    "COMMITTED",
    "COORDINATOR",
    "Deletion",
    "Failure",
    "Outcome",
    "Phase",
    "ProtocolError",
    "RankReport",
    "Report",
    "Timings",
    "Verdict",
    "malformed",
    "report_from_json",
]
