"""The commit protocol's records (``core/commit/protocol.py``) on the wire.

Reports and outcomes go through the real ``StoreCoordinator`` over an in-memory c10d-like
store: they come back equal, their bytes are those of the dicts the protocol exchanged
before it was typed (member names and order), and a message that is not a record is refused
with a ``ProtocolError`` naming the step, the rank and the store key.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import pytest

from shardkeeper.core.commit.protocol import (
    COMMITTED,
    Failure,
    Outcome,
    Phase,
    ProtocolError,
    RankReport,
    Timings,
    Verdict,
    report_from_json,
)
from shardkeeper.core.errors import CheckpointTimeoutError
from shardkeeper.core.format.table import ChunkTable, report_for_wire, rows_report
from shardkeeper.core.runtime.coordinator import StoreCoordinator
from shardkeeper.core.runtime.store_channel import StoreTimeout

NS = "shardkeeper/00ff"


class _Store:
    """The c10d store calls the coordinator makes, in memory (values come back as bytes);
    ``calls`` counts them by caller rank (``as_rank``): each is a round trip to the server."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: dict[int, int] = {}
        self.as_rank = 0

    def __getattribute__(self, name: str) -> Any:
        if name in ("set", "get", "check", "delete_key", "add", "wait", "multi_get"):
            calls = object.__getattribute__(self, "calls")
            rank = object.__getattribute__(self, "as_rank")
            calls[rank] = calls.get(rank, 0) + 1
        return object.__getattribute__(self, name)

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if not all(k in self.data for k in keys):
            raise StoreTimeout(f"wait timeout after {timeout}")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]


@dataclass
class _OnStore(StoreCoordinator):
    store: Any = None

    @property
    def _store(self) -> Any:
        self.store.as_rank = self.rank
        return self.store


def _pair(world: int = 2) -> tuple[_Store, _OnStore, _OnStore]:
    store = _Store()
    return store, _OnStore(None, 0, world, NS, store=store), _OnStore(None, 1, world, NS, store=store)


def _report(rank: int = 1, **changes: Any) -> RankReport:
    recs = [
        {
            "file": "data/r1-0.skt",
            "offset": 64,
            "length": 24,
            "offsets": [0, 0],
            "shape": [2, 3],
            "digests": "0123456789abcdef0123456789abcdef",
        },
        {
            "file": "data/r1-0.skt",
            "offset": 88,
            "length": 8,
            "offsets": [0],
            "shape": [2],
            "digests": "fedcba9876543210fedcba9876543210",
        },
    ]
    report = RankReport(
        rank=rank,
        attempt="a1b2c3",
        declared={"rng/1": ["per_rank", "uint8", [16]]},
        declared_digest="9f" * 16,
        chunks=rows_report(["model/w", "model/b"], ChunkTable.from_records(recs, 0)),
        files={"data/r1-0.skt": {"size_bytes": 96, "rank": rank}},
        objects={"epoch": 3, "lr": 1e-3, "nan": math.nan, "big": 1 << 70, "text": "é\n"},
        bases=[4],
        extended=True,
        per_rank_prefixes=["rng/"],
        layouts=["DTensor(mesh=(2,), placements=(Shard(0),))"],
        timings=Timings(stall_s=0.25, write_s=1.5, sync=False),
    )
    return replace(report, **changes)


def _same(a: Any, b: Any) -> bool:
    """Equal by value, NaN equal to NaN (as the JSON values of a state are compared)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_a_report_crosses_the_store_unchanged_in_the_bytes_it_always_had() -> None:
    store, coord0, coord1 = _pair()
    sent = _report()
    coord1.report(7, sent)
    key = f"{NS}/7/report/1"
    # The wire format: the dict the protocol sent before it was typed, member for member.
    before = {
        "ok": True,
        "rank": 1,
        "attempt": "a1b2c3",
        "declared": sent.declared,
        "declared_digest": sent.declared_digest,
        "chunks": report_for_wire(sent.chunks),
        "files": sent.files,
        "objects": sent.objects,
        "bases": [4],
        "extended_json": True,
        "per_rank_prefixes": ["rng/"],
        "layouts": sent.layouts,
        "timings": {"stall_s": 0.25, "write_s": 1.5, "sync": False},
    }
    assert store.data[key] == json.dumps(before).encode()
    own = _report(rank=0)
    got = coord0.collect(7, own, 5.0, step=7)
    assert isinstance(got, list) and got[0] is own
    coord1.report(8, sent)  # a rank's next report deletes its previous one, already read
    assert key not in store.data and f"{NS}/8/report/1" in store.data
    back = got[1]
    assert isinstance(back, RankReport)
    assert _same(back.objects, sent.objects) and back.objects["big"] == 1 << 70  # exact: declared extended
    assert math.isnan(back.objects["nan"])
    assert back.chunks == report_for_wire(sent.chunks)
    assert replace(back, objects=sent.objects, chunks=sent.chunks) == sent
    assert _same(back.to_json(), before)
    # What the coordinator merges: the wire member names, its own chunks kept as objects.
    assert own.members()["chunks"]["table"] is own.chunks["table"]
    assert list(own.members()) == list(before)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_failure_round_trips_and_says_conflict_only_for_a_commit(phase: Phase) -> None:
    f = Failure.of(
        1, phase, "/ckpt/step-00000007", OSError(28, "No space left on device"), conflict=phase is Phase.COMMIT
    )
    doc = f.to_json()
    assert list(doc) == ["ok", "rank", "phase", "path", "error"] + (["conflict"] if phase is Phase.COMMIT else [])
    assert doc["phase"] == phase.value and doc["error"] == "OSError: [Errno 28] No space left on device"
    assert Failure.from_json(json.loads(json.dumps(doc)), where="test") == f
    assert f"{phase}" == phase.value  # messages say "write", not "Phase.WRITE"


def test_a_failure_report_ends_the_collection_and_the_outcome_reaches_every_rank() -> None:
    store, coord0, coord1 = _pair(world=3)
    failure = Failure(1, Phase.WRITE, "/ckpt/step-00000007", "OSError: disk full")
    coord1.report(7, failure)
    assert (
        store.data[f"{NS}/7/report/1"]
        == json.dumps(
            {"ok": False, "rank": 1, "phase": "write", "path": "/ckpt/step-00000007", "error": "OSError: disk full"}
        ).encode()
    )
    assert coord0.collect(7, _report(rank=0), 5.0, step=7) == failure  # before rank 2 reported
    coord0.publish(7, Outcome(failure))
    assert coord1.outcome(7, 1.0, step=7) == Outcome(failure)
    coord2 = _OnStore(None, 2, 3, NS, store=store)
    assert coord2.outcome(7, 1.0, step=7) == Outcome(failure)
    assert not [k for k in store.data if "/7/outcome" in k or "/7/acks" in k]  # the last reader removed them


def test_the_outcomes_bytes_and_round_trip() -> None:
    store, coord0, coord1 = _pair()
    coord0.publish(3, COMMITTED)
    assert store.data[f"{NS}/3/outcome"] == b'{"ok": true, "rank": 0}'
    assert coord1.outcome(3, 1.0, step=3) == COMMITTED and COMMITTED.ok
    conflict = Outcome(Failure(0, Phase.COMMIT, "s3://b/r/step-00000003", "CommitConflictError: exists", True))
    coord0.publish(4, conflict)
    assert (
        store.data[f"{NS}/4/outcome"]
        == json.dumps(
            {
                "ok": False,
                "rank": 0,
                "phase": "commit",
                "path": "s3://b/r/step-00000003",
                "error": "CommitConflictError: exists",
                "conflict": True,
            }
        ).encode()
    )
    got = coord1.outcome(4, 1.0, step=4)
    assert got == conflict and not got.ok and got.failure is not None and got.failure.conflict


def _without(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != name}


_GOOD = _report().to_json()
MALFORMED = {
    "not JSON": b'{"ok": true, "rank": 1, ',
    "an array": b"[1, 2]",
    "no ok": json.dumps(_without(_GOOD, "ok")).encode(),
    "files missing": json.dumps(_without(_GOOD, "files")).encode(),
    "files a list": json.dumps({**_GOOD, "files": ["data/r1-0.skt"]}).encode(),
    "rank a bool": json.dumps({**_GOOD, "rank": True}).encode(),
    "rank of another key": json.dumps({**_GOOD, "rank": 2}).encode(),
    "bases of strings": json.dumps({**_GOOD, "bases": ["4"]}).encode(),
    "chunks per record": json.dumps({**_GOOD, "chunks": {"model/w": [{"file": "x"}]}}).encode(),
    "declaration short": json.dumps({**_GOOD, "declared": {"rng/1": ["per_rank", "uint8"]}}).encode(),
    "timings a number": json.dumps({**_GOOD, "timings": 1.5}).encode(),
    "unknown phase": json.dumps({"ok": False, "rank": 1, "phase": "upload", "path": "/p", "error": "E: x"}).encode(),
    "failure without error": json.dumps({"ok": False, "rank": 1, "phase": "write", "path": "/p"}).encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_report_in_the_store_is_refused_naming_step_rank_and_key(case: str) -> None:
    store, coord0, coord1 = _pair()
    key = f"{NS}/9/report/1"
    coord1.report(9, _report())
    store.data[key] = MALFORMED[case]
    with pytest.raises(ProtocolError) as e:
        coord0.collect(9, _report(rank=0), 5.0, step=9)
    msg = str(e.value)
    assert "step 9" in msg and "rank 1" in msg and key in msg, msg
    assert "same shardkeeper version" in msg and "not committed" in msg, msg


def test_the_refusals_say_what_is_wrong() -> None:
    with pytest.raises(ProtocolError, match=r"member 'files' is list \[\], not an object"):
        report_from_json({**_GOOD, "files": []}, rank=1, where="w")
    with pytest.raises(ProtocolError, match=r"member 'rank' is bool True, not an integer"):
        report_from_json({**_GOOD, "rank": True}, rank=1, where="w")
    with pytest.raises(ProtocolError, match=r"from rank 2, its key is rank 1's"):
        report_from_json({**_GOOD, "rank": 2}, rank=1, where="w")
    with pytest.raises(ProtocolError, match=r"member 'bases' is list \['4'\], not a list of integers"):
        report_from_json({**_GOOD, "bases": ["4"]}, rank=1, where="w")
    with pytest.raises(ProtocolError, match=r"phase 'upload' is none of check, stage, write, replicate, commit"):
        Failure.from_json({"ok": False, "rank": 1, "phase": "upload", "path": "/p", "error": "E"}, where="w")


#: every member of a report (and of its declarations, chunks, files and timings), with a
#: value of another kind, and the words its refusal names it with
WRONG_MEMBERS: dict[tuple[str, ...], tuple[Any, str]] = {
    ("rank",): (None, "member 'rank'"),
    ("attempt",): (7, "member 'attempt'"),
    ("declared_digest",): ([], "member 'declared_digest'"),
    ("declared",): ([], "member 'declared'"),
    ("declared", "rng/1"): (["per_rank", "uint8", [16], 1], "the declaration of 'rng/1'"),
    ("chunks",): ("x", "member 'chunks'"),
    ("chunks", "keys"): ([1, 2], "member 'keys'"),
    ("chunks", "counts"): (["1"], "member 'counts'"),
    ("chunks", "table"): ([], "member 'table'"),
    ("files",): ([], "member 'files'"),
    ("files", "data/r1-0.skt"): (96, "the record of file 'data/r1-0.skt'"),
    ("objects",): ([], "member 'objects'"),
    ("bases",): ([True], "member 'bases'"),
    ("extended_json",): (1, "member 'extended_json'"),
    ("per_rank_prefixes",): ([1], "member 'per_rank_prefixes'"),
    ("layouts",): ("DTensor", "member 'layouts'"),
    ("timings",): ([], "member 'timings'"),
    ("timings", "stall_s"): ("0.25", "member 'stall_s'"),
    ("timings", "write_s"): (None, "member 'write_s'"),
    ("timings", "sync"): (0, "member 'sync'"),
}


@pytest.mark.parametrize("path", sorted(WRONG_MEMBERS), ids="/".join)
def test_every_member_of_another_kind_is_refused_by_name(path: tuple[str, ...]) -> None:
    """A well-formed report is checked in one pass, any other member by member: whichever
    member is wrong, the refusal names it (and a missing member, too)."""
    value, named = WRONG_MEMBERS[path]
    doc = json.loads(json.dumps(_GOOD))
    at = doc
    for part in path[:-1]:
        at = at[part]
    at[path[-1]] = value
    with pytest.raises(ProtocolError, match=re.escape(named)):
        report_from_json(doc, rank=1, where="w")
    if path[0] not in ("declared", "files") or len(path) == 1:  # (their entries may be absent)
        del at[path[-1]]
        with pytest.raises(ProtocolError, match=re.escape(f"member {path[-1]!r} is missing")):
            report_from_json(doc, rank=1, where="w")
    assert report_from_json(json.loads(json.dumps(_GOOD)), rank=1, where="w").rank == 1


@pytest.mark.parametrize(
    ("name", "bad"),
    [("bases", True), ("bases", 1.0), ("bases", None), ("per_rank_prefixes", 7), ("per_rank_prefixes", ["a/"])],
)
@pytest.mark.parametrize("at", [0, 5_000, -1])
def test_one_item_of_another_kind_anywhere_in_a_long_list_is_refused(name: str, bad: Any, at: int) -> None:
    """Lists are checked item by item, whatever their length: one item of another kind (a bool
    among integers, too) at the start, the middle or the end is named."""
    good: Any = list(range(10_000)) if name == "bases" else [f"p{i}/" for i in range(10_000)]
    assert report_from_json({**_GOOD, name: good}, rank=1, where="w").rank == 1
    good[at] = bad
    with pytest.raises(ProtocolError, match=re.escape(f"member {name!r} is list")):
        report_from_json({**_GOOD, name: good}, rank=1, where="w")


def test_a_malformed_outcome_is_refused_naming_step_rank_and_key() -> None:
    store, _, coord1 = _pair()
    key = f"{NS}/5/outcome"
    for data in (b"[]", b'{"rank": 0}', b'{"ok": false, "rank": 0, "phase": "commit"}', b"{"):
        store.data[key] = data
        with pytest.raises(ProtocolError) as e:
            coord1.outcome(5, 1.0, step=5)
        msg = str(e.value)
        assert "step 5" in msg and "rank 1" in msg and key in msg, msg


def test_the_ranks_agree_on_the_worst_verdict() -> None:
    """The restore agreement is one all_reduce max: its order is the severity."""
    assert sorted(Verdict) == [Verdict.RESTORED, Verdict.DAMAGED, Verdict.FATAL]
    assert Verdict(max(int(Verdict.RESTORED), int(Verdict.DAMAGED))) is Verdict.DAMAGED


@pytest.mark.parametrize("world", [2, 64])
def test_the_coordinator_makes_the_same_few_round_trips_at_any_world_size(world: int) -> None:
    """The coordinator neither polls the ranks one by one nor deletes their reports: one
    wait, one count, one multi_get, and its own outcome and clean-up, at 2 ranks as at 64."""
    store = _Store()
    coords = [_OnStore(None, r, world, NS, store=store) for r in range(world)]
    for c in coords[1:]:
        c.report(7, _report(rank=c.rank))
    # each rank: set its report, count it in; the last one to count in also sets the wake key
    assert [store.calls[r] for r in range(1, world)] == [2] * (world - 2) + [3]
    store.calls[0] = 0
    got = coords[0].collect(7, _report(rank=0), 5.0, step=7)
    assert isinstance(got, list) and [g.rank for g in got] == list(range(world))
    coords[0].publish(7, COMMITTED)
    assert store.calls[0] == 7  # wait, add, multi_get; set the outcome, delete count/wake/failed
    assert not [k for k in store.data if k.endswith(("/7/count", "/7/wake", "/7/failed"))]


def test_a_late_rank_is_named_by_the_timeout() -> None:
    store = _Store()
    coords = [_OnStore(None, r, 4, NS, store=store) for r in range(4)]
    coords[1].report(3, _report(rank=1))
    coords[3].report(3, _report(rank=3))
    with pytest.raises(CheckpointTimeoutError, match=r"step 3: ranks \[2\] did not report within 5 s"):
        coords[0].collect(3, _report(rank=0), 5.0, step=3)


@pytest.mark.parametrize(
    ("world", "group", "leaders"), [(4, 2, [0, 1, 3]), (260, 128, [0, 1, 129, 257]), (128, 128, [])]
)
def test_in_a_group_commit_the_coordinator_is_a_group_of_its_own(world: int, group: int, leaders: list[int]) -> None:
    """Above ``commit_group_ranks`` ranks, rank 0 folds no other rank's report: ranks 1, 2, ...
    form groups of ``group`` led by their first rank, every rank reports to its leader, and the
    coordinator hears from the leaders alone (at 128 ranks, no groups: every rank reports to it)."""
    store = _Store()
    coords = [_OnStore(None, r, world, NS, store=store) for r in range(world)]
    for c in coords:
        c.group_ranks = group
    assert [c.rank for c in coords if c.leads()] == leaders
    for c in coords[1:]:
        if not c.leads():
            c.report(5, _report(rank=c.rank))
    for r in leaders[1:]:  # each leader hears exactly its group, in rank order
        got = coords[r].collect_group(5, 5.0, step=5)
        assert isinstance(got, list)
        assert [g.rank for g in got] == list(range(r + 1, min(r + group, world)))
        coords[r].report(5, _report(rank=r))
    if leaders:  # the coordinator's group: itself
        assert coords[0].collect_group(5, 5.0, step=5) == []
    got = coords[0].collect(5, _report(rank=0), 5.0, step=5)
    assert isinstance(got, list) and [g.rank for g in got] == (leaders or list(range(world)))


def test_a_failed_saves_keys_written_late_are_deleted_after_the_next_commit() -> None:
    """A save fails while a rank of a group has not reported; that rank, and its leader, write
    their keys after the coordinator published the failure. The next committed save deletes
    them: a job's failed saves do not fill the store."""
    world, group = 4, 2  # groups: {0}, {1, 2}, {3}
    store = _Store()
    coords = [_OnStore(None, r, world, NS, store=store) for r in range(world)]
    for c in coords:
        c.group_ranks = group
    failure = Failure(3, Phase.WRITE, "/ckpt/step-00000005", "OSError: disk full")
    coords[3].report(5, failure)  # a leader of its own group fails
    assert coords[0].collect(5, _report(rank=0), 5.0, step=5) == failure
    coords[0].publish(5, Outcome(failure))
    for r in range(1, world):
        assert coords[r].outcome(5, 1.0, step=5) == Outcome(failure)
    coords[2].report(5, _report(rank=2))  # late: after the outcome, into its leader's keys
    coords[1].report(5, failure)  # and its leader reports a failure of its own, late too
    lingering = [k for k in store.data if "/5/" in k and "/report/" not in k]
    assert lingering  # control: the late ranks wrote keys the publish had deleted
    for c in coords[1:]:  # the next save commits
        if not c.leads():
            c.report(6, _report(rank=c.rank))
    for r in (1, 3):
        got = coords[r].collect_group(6, 5.0, step=6)
        assert isinstance(got, list)
        coords[r].report(6, _report(rank=r))
    assert isinstance(coords[0].collect(6, _report(rank=0), 5.0, step=6), list)
    coords[0].publish(6, COMMITTED)
    assert [k for k in store.data if "/5/" in k and "/report/" not in k] == []
    for r in range(1, world):
        assert coords[r].outcome(6, 1.0, step=6) == COMMITTED
    # each rank deletes its own previous report at its next one; only save 6's reports are left
    assert sorted(k.rsplit("/", 3)[-3] for k in store.data) == ["6", "6", "6"], sorted(store.data)
