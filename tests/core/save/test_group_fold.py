"""A group leader's fold (save/group.py) on a real local root: equal reports count
once, differing ones travel inside the leader's, the page is written while the group's files
are checked, and whichever fails, the fold returns only once the page's write has ended;
the report comes back with the page's write still under way, waited for by the caller."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.commit.protocol import RankReport, Timings
from shardkeeper.core.errors import CorruptCheckpointError, StorageError
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.layout import page_file, step_dir
from shardkeeper.core.format.table import rows_report
from shardkeeper.core.save.group import fold_group, unfold
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.storage.wrapper import StorageWrapper
from shardkeeper.core.testing.faults import FaultyStorage

STEP = 3
ATTEMPT = "0123abcd"


def _report(r: int, *, objects: dict[str, Any] | None = None, stall_s: float = 0.0) -> RankReport:
    """Rank ``r``'s report of a save of described leaves only: its data file and index file."""
    data, index = f"data/r{r:05d}-{ATTEMPT}-000.safetensors", f"data/r{r:05d}-{ATTEMPT}.index.json"
    return RankReport(
        rank=r,
        attempt=ATTEMPT,
        declared={},
        declared_digest="d" * 32,
        chunks=rows_report([], ChunkTable([], [], [], [], [], [], [], [], {}, 0)),
        files={data: {"size_bytes": 100 + r, "rank": r}, index: {"size_bytes": 10, "rank": r}},
        objects=objects or {},
        bases=[],
        extended=False,
        per_rank_prefixes=[],
        layouts=[],
        timings=Timings(stall_s=stall_s, write_s=1.0),
        described={"digest": "rule", "index": [index, 10, "0" * 32], "chunk_files": [[data, 100 + r]]},
    )


def _files(root: Path, reports: list[RankReport], *, skip: str = "") -> None:
    for rep in reports:
        for rel, rec in rep.files.items():
            if rel != skip:
                path = root / step_dir(STEP) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"x" * rec["size_bytes"])


def _fold(storage: Any, reports: list[RankReport], io: ThreadPoolExecutor) -> RankReport:
    """A leader's fold, as it reports it: once its page is durable."""
    folded, written = fold_group(storage, step_dir(STEP), STEP, ATTEMPT, reports, algorithm="xxh3_128", executor=io)
    if written is not None:
        written.result()
    return folded


@pytest.fixture
def io() -> Any:
    with ThreadPoolExecutor(2) as pool:
        yield pool


def test_equal_reports_count_once_and_a_differing_one_travels_in_the_leaders(tmp_path: Path, io: Any) -> None:
    reports = [_report(r, stall_s=0.1 * r) for r in range(4)]
    reports[2] = _report(2, objects={"epoch": 1})  # a rank whose report differs
    _files(tmp_path, reports)
    folded = _fold(LocalStorage(tmp_path), reports, io)
    assert folded.rank == 0 and folded.ranks == [[0, 1], [3, 3]]
    assert folded.timings.stall_s == pytest.approx(0.3) and folded.timings.write_s == 1.0
    group = folded.group
    assert group["count"] == 4 and [o.rank for o in group["others"]] == [2]
    assert group["others"][0].ranks == [[2, 2]] and group["others"][0].objects == {"epoch": 1}
    # the ranks' files went to the page; the leader's report lists the page alone
    rel, size = group["page"][0], group["page"][1]
    assert rel == page_file(0, ATTEMPT) and list(folded.files) == [rel]
    assert (tmp_path / step_dir(STEP) / rel).stat().st_size == size
    assert group["page"][3:] == [8, sum(100 + r + 10 for r in range(4))]
    assert folded.described == {"digest": "rule", "index": None, "chunk_files": []}
    assert group["others"][0].files == {} and group["others"][0].described["index"] is None
    reports_, pages, refs = unfold([folded])
    assert [r.rank for r in reports_] == [0, 2] and pages == [(0, 4, group["page"])] and refs == {}


def _slow_failure(done: list[str]) -> Any:
    def error(op: str, path: str) -> Exception:
        time.sleep(0.5)  # the page's write fails late, after the files' check
        done.append(path)
        return OSError(5, "injected fault")

    return error


def test_a_lost_file_is_the_error_and_the_pages_write_has_ended_first(tmp_path: Path, io: Any) -> None:
    reports = [_report(r) for r in range(3)]
    _files(tmp_path, reports, skip=f"data/r00002-{ATTEMPT}-000.safetensors")
    done: list[str] = []
    storage = FaultyStorage(LocalStorage(tmp_path), fail_on={"close": "*/pages/*"}, error=_slow_failure(done))
    with pytest.raises(CorruptCheckpointError, match=r"r00002-.*\(written by rank 2\) is missing at commit time"):
        _fold(storage, reports, io)
    seen = list(done)
    io.shutdown(wait=True)  # a write still in flight would end now
    assert done == seen


def test_a_page_that_cannot_be_written_fails_the_fold(tmp_path: Path, io: Any) -> None:
    reports = [_report(r) for r in range(3)]
    _files(tmp_path, reports)
    done: list[str] = []
    storage = FaultyStorage(LocalStorage(tmp_path), fail_on={"close": "*/pages/*"}, error=_slow_failure(done))
    with pytest.raises(StorageError, match="injected fault"):
        _fold(storage, reports, io)
    assert len(done) == 1


class _SlowPages(StorageWrapper):
    """A local root whose pages take 0.5 s to close (to sync)."""

    def open_writer(self, path: str) -> Any:
        writer = self.inner.open_writer(path)
        if "/pages/" in path:
            close = writer.close

            def slow_close() -> None:
                time.sleep(0.5)
                close()

            writer.close = slow_close
        return writer


def test_the_fold_returns_with_the_page_still_being_synced(tmp_path: Path, io: Any) -> None:
    """The report comes back before its page is durable (the coordinator's page syncs while it
    merges); the page is there, whole, once the write ends."""
    reports = [_report(r) for r in range(3)]
    _files(tmp_path, reports)
    storage = _SlowPages(LocalStorage(tmp_path))
    t0 = time.monotonic()
    folded, written = fold_group(storage, step_dir(STEP), STEP, ATTEMPT, reports, algorithm="xxh3_128", executor=io)
    assert written is not None and not written.done() and time.monotonic() - t0 < 0.4
    page = tmp_path / step_dir(STEP) / folded.group["page"][0]
    written.result()
    assert page.stat().st_size == folded.group["page"][1]
    assert folded.ranks == [[0, 2]] and folded.group["count"] == 3


def _holding(rep: RankReport, copies: dict[str, tuple[int, int]]) -> RankReport:
    """``rep`` with a ``replicas`` member: key -> (its copy's number, its sum)."""
    from dataclasses import replace

    from shardkeeper.core.format.logical_member import REPLICAS, encode_sums

    keys = sorted(copies)
    member = {"keys": keys, "copies": [copies[k][0] for k in keys], "sums": encode_sums(copies[k][1] for k in keys)}
    return replace(rep, chunks={**rep.chunks, REPLICAS: member})


def test_ranks_that_differ_only_by_the_copy_they_hold_fold_into_one(tmp_path: Path, io: Any) -> None:
    """Under DDP each rank holds its own copy of the replicated tensors: its report differs
    from its neighbours' only by its copy's number. The leader folds the copies' sums into one
    member, so the group's reports fold again, and the coordinator still names a copy that
    differs (format/replica_copies.py)."""
    from shardkeeper.core.format.logical_member import combine_reports

    reports = [_holding(_report(r), {"model/w": (r, 7), "model/b": (r, 9)}) for r in range(1, 5)]
    _files(tmp_path, reports)
    folded = _fold(LocalStorage(tmp_path), reports, io)
    assert folded.ranks == [[1, 4]] and folded.group["others"] == []
    member = folded.chunks["replicas"]
    assert member["keys"] == ["model/b", "model/w"] and member["copies"] == [[[1, 4]], [[1, 4]]]
    declared = {"model/b": ["tensor", "float32", [2]], "model/w": ["tensor", "float32", [2]]}
    writer = {"rank": 0, "chunks": {"keys": ["model/b", "model/w"], "logical": "9,7"}}
    agreed = combine_reports([writer, {"rank": 1, "chunks": {**folded.chunks, "logical": ""}}], declared, [])
    assert agreed is not None and "replicas_disagree" not in agreed
    odd = [_holding(_report(r), {"model/w": (r, 8 if r == 3 else 7)}) for r in range(1, 5)]
    _files(tmp_path / "odd", odd)
    folded = _fold(LocalStorage(tmp_path / "odd"), odd, io)
    assert folded.group["others"] == []
    member = combine_reports([writer, {"rank": 1, "chunks": {**folded.chunks, "logical": ""}}], declared, [])
    assert member is not None
    assert member["replicas_disagree"] == (
        "tensor 'model/w': the copy on rank(s) [3] differs from the one rank(s) [0] wrote"
    ), member


def test_a_copy_split_over_two_groups_adds_its_parts() -> None:
    """A copy whose pieces lie on ranks of two groups (an HSDP shard group wider than
    ``commit_group_ranks``): each leader sends its part, the coordinator adds them."""
    from shardkeeper.core.format.logical_member import combine_reports
    from shardkeeper.core.format.replica_copies import fold

    declared = {"t": ["tensor", "float32", [4]]}
    writer = {"rank": 0, "chunks": {"keys": ["t"], "logical": "a"}}
    first = fold([(1, {"keys": ["t"], "copies": [1], "sums": "3"}), (2, {"keys": ["t"], "copies": [2], "sums": "3"})])
    second = fold([(3, {"keys": ["t"], "copies": [1], "sums": "7"}), (4, {"keys": ["t"], "copies": [2], "sums": "7"})])
    assert first is not None and second is not None
    leaders = [
        {"rank": 1, "chunks": {"keys": [], "logical": "", "replicas": first}},
        {"rank": 3, "chunks": {"keys": [], "logical": "", "replicas": second}},
    ]
    member = combine_reports([writer, *leaders], declared, [])
    assert member is not None and "replicas_disagree" not in member, member
    second = fold([(3, {"keys": ["t"], "copies": [1], "sums": "7"}), (4, {"keys": ["t"], "copies": [2], "sums": "6"})])
    leaders[1] = {"rank": 3, "chunks": {"keys": [], "logical": "", "replicas": second}}
    member = combine_reports([writer, *leaders], declared, [])
    assert member is not None
    assert member["replicas_disagree"] == (
        "tensor 't': the copy 2, held among rank(s) [1, 2, 4], differs from the one rank(s) [0] wrote"
    )
