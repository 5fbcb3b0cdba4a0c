"""The chunk and leaf tables (docs/format.md 3.6, 3.7): the columnar form of large manifests.

Checkpoints with at least ``TABLE_MIN_CHUNKS`` chunks store their chunk records as columns;
here the threshold is lowered so that small, real saves take that form. Restores are compared
bit for bit; damaged tables fail with a CheckpointError when the manifest is read.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.merge import assemble_manifest
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.leaf_table import LeafTable
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.reports import (
    decode_report,
    encode_report,
    report_for_wire,
    rows_report,
)
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.format.table_checks import all_slabs, leaf_chunks_problem
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step
from tests.checks import assert_checks, assert_same_state, read_checks
from tests.core.format.test_hostile import JSON_VALUES, _apply, _parse_ok_or_checkpoint_error, _paths

MDIR = "step-000000000001/manifest.json"


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {f"l{i}": torch.randn(3 + i, 5) for i in range(6)},
        "scalar": torch.tensor(2.5),
        "ints": torch.arange(7, dtype=torch.int64),
        "extra": {"blob": b"some bytes", "cfg": {"lr": 0.1}},
    }


def zero_state() -> dict[str, Any]:
    return {
        "model": {f"l{i}": torch.zeros(3 + i, 5) for i in range(6)},
        "scalar": torch.tensor(0.0),
        "ints": torch.zeros(7, dtype=torch.int64),
        "extra": {"blob": b"", "cfg": {"lr": 0.0}},
    }


@pytest.fixture()
def table_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shardkeeper.core.commit.merge.TABLE_MIN_CHUNKS", 1)


@pytest.mark.parametrize("digest", ["xxh3_128", "sha256"])
def test_table_form_round_trips_bit_for_bit(tmp_path: Path, table_form: None, digest: str) -> None:
    with CheckpointManager(tmp_path, digest=digest, digest_block_bytes=64) as mgr:
        mgr.save(1, make_state(), async_save=False)
        doc = json.loads((tmp_path / MDIR).read_text())
        assert doc["format_version"] == 1 and "requires" not in doc and "chunk_table" in doc
        assert all(leaf["kind"] == "object" for leaf in doc["leaves"].values())  # tensors: the leaf table
        assert "model/l1" in doc["leaf_table"]["keys"] and len(doc["leaf_table"]["rows"]) == len(
            doc["chunk_table"]["file"]
        )
        target = zero_state()
        assert mgr.restore(target) == 1
        # only= reads just the chunks of the keys asked for
        part = zero_state()
        mgr.restore(part, only=["model/l2"])
    want = make_state()
    assert_same_state(target["model"], want["model"], what="the model")
    assert torch.equal(part["model"]["l2"], want["model"]["l2"]) and not part["model"]["l1"].any()
    assert torch.equal(target["scalar"], want["scalar"]) and torch.equal(target["ints"], want["ints"])
    assert target["extra"] == {"blob": b"some bytes", "cfg": {"lr": 0.1}}
    storage = LocalStorage(tmp_path)
    report = verify_step(storage, 1, read_bytes=1 << 30)
    assert not report.problems
    m = Manifest.loads((tmp_path / MDIR).read_bytes())
    # the same records as the per-chunk form, and the same text again when written back
    assert {c.file for _, c in m.chunks()} <= m.referenced_files()
    assert Manifest.loads(m.dumps()).to_json() == m.to_json()


def test_small_checkpoints_keep_the_per_chunk_form(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, make_state(), async_save=False)
    doc = json.loads((tmp_path / MDIR).read_text())
    assert "chunk_table" not in doc and all("chunks" in v for v in doc["leaves"].values() if v["kind"] != "object")


def _table_doc(tmp_path: Path) -> dict[str, Any]:
    import shardkeeper.core.commit.merge as asm

    old = asm.TABLE_MIN_CHUNKS
    asm.TABLE_MIN_CHUNKS = 1
    try:
        with CheckpointManager(tmp_path, digest_block_bytes=64) as mgr:
            mgr.save(1, make_state(), async_save=False)
    finally:
        asm.TABLE_MIN_CHUNKS = old
    return json.loads((tmp_path / MDIR).read_text())


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


DAMAGE: list[tuple[str, Any, str]] = [
    ("chunk_table.offset.0", -1, "non-negative integers"),
    ("chunk_table.offset.0", True, "non-negative integers"),
    ("chunk_table.length.1", "8", "non-negative integers"),
    ("chunk_table.file.0", 7, "beyond its files"),
    ("chunk_table.files.0", "../../etc/passwd", "not a path inside the root"),
    ("chunk_table.files.0", "/abs/data", "not a path inside the root"),
    ("chunk_table.files.0", "manifest.json", "to a data file"),
    ("chunk_table.ndim.0", 3, "offsets/shape do not match"),
    ("chunk_table.digests", "abc", "hex digits"),
    ("chunk_table.digests", ["x"], "not a string"),
    ("chunk_table.shape.0", 999, ""),
    ("chunk_table.offset.0", 1 << 40, "beyond the end"),
    ("leaf_table.rows.2", 0, ""),  # a chunk listed twice (for two leaves), another missing
    ("leaf_table.rows.0", 10**6, "not a list of table rows"),
    ("leaf_table.rows", "0", "not arrays"),
    ("leaf_table.nrows.0", 0, "do not match"),
    ("leaf_table.keys.0", 5, "distinct strings"),
    ("leaf_table.kind.0", "weird", "unknown leaf kind"),
    ("leaf_table.dtype.0", "float128", "unknown dtype"),
    ("leaf_table.shape.0", -1, "non-negative integers"),
    ("leaf_table.shape.0", 99, ""),
    ("leaf_table.ndim.0", 70, ""),
    ("leaf_table", 7, "malformed"),
    ("leaves.model/l1", {"kind": "tensor"}, "not an object"),
    ("chunk_table.extras", {"encoding": ["bogus"]}, ""),
]


@pytest.mark.parametrize(("path", "value", "why"), DAMAGE, ids=[f"{p}={v!r}"[:40] for p, v, _ in DAMAGE])
def test_damaged_tables_are_refused_when_read(tmp_path: Path, path: str, value: Any, why: str) -> None:
    doc = _table_doc(tmp_path)
    if path == "chunk_table.extras":
        value = {"encoding": ["bogus"] * len(doc["chunk_table"]["offset"])}
    _set(doc, path, value)
    with pytest.raises(CorruptCheckpointError, match=why or None):
        Manifest.loads(json.dumps(doc).encode(), where="t")
    (tmp_path / MDIR).write_text(json.dumps(doc))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointError):
        mgr.restore(zero_state(), step=1)


@pytest.mark.parametrize("member", ["leaf_table", "chunk_table"])
def test_one_table_without_the_other_is_refused(tmp_path: Path, member: str) -> None:
    """The tables come together: a reader finds a table-form manifest's tensor leaves in the
    leaf table and their chunks in the chunk table, never one without the other."""
    doc = _table_doc(tmp_path)
    del doc[member]
    with pytest.raises(CorruptCheckpointError, match="without a"):
        Manifest.loads(json.dumps(doc).encode())


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_fuzz_table_mutations(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    doc = _TABLE_DOC.get("doc") or _TABLE_DOC.setdefault("doc", _table_doc(tmp_path_factory.mktemp("t")))
    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(["replace", "delete", "wrap", "duplicate", "negate", "huge"]))
        try:
            _apply(doc, path, op, data.draw(JSON_VALUES) if op == "replace" else None)
        except (KeyError, IndexError, TypeError):
            pass
    _parse_ok_or_checkpoint_error(json.dumps(doc).encode())


_TABLE_DOC: dict[str, Any] = {}


def _rec(offsets: list[int], shape: list[int], file: str = "data/f") -> dict[str, Any]:
    n = 4 * shape[0] * shape[1]
    return {"file": file, "offset": 0, "length": n, "offsets": offsets, "shape": shape, "digests": "a" * 32}


def _report(rank: int, declared: dict[str, Any], chunks: dict[str, Any], wire: bool) -> dict[str, Any]:
    c = json.loads(json.dumps(encode_report(chunks, 0))) if wire else chunks
    return {
        "rank": rank,
        "declared": declared,
        "chunks": c,
        "files": {"data/f": {"size_bytes": 1 << 20, "rank": rank}},
        "objects": {},
        "per_rank_prefixes": [],
    }


@pytest.mark.parametrize("threshold", [1, 10**9], ids=["table", "per-chunk"])
def test_coordinator_merges_columnar_reports(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr("shardkeeper.core.commit.merge.TABLE_MIN_CHUNKS", threshold)
    decl = {"w": ["tensor", "float32", [6, 2]], "r": ["tensor", "float32", [2, 2]]}
    kw = {"world_size": 3, "digest": "xxh3_128", "block_bytes": 1 << 20, "metadata": {}}
    reports = [
        _report(r, decl if r == 0 else {}, {"w": [_rec([2 * r, 0], [2, 2])], "r": [_rec([0, 0], [2, 2])]}, wire=r > 0)
        for r in range(3)
    ]
    m = assemble_manifest(3, "a", reports, **kw)
    assert [c.offsets for c in m.leaves["w"].chunks] == [(0, 0), (2, 0), (4, 0)]
    assert len(m.leaves["r"].chunks) == 1  # a replica written by three ranks counts once
    assert m.leaves["w"].chunks[1].digests == ("a" * 32,)
    back = Manifest.loads(m.dumps())
    assert [c.offsets for c in back.leaves["w"].chunks] == [(0, 0), (2, 0), (4, 0)]
    gap = [reports[0], reports[2], _report(1, {}, {"r": [_rec([0, 0], [2, 2])]}, wire=True)]
    with pytest.raises(StateMismatchError, match=r"step 3.*w: chunks cover 8 of 12"):
        assemble_manifest(3, "a", gap, **kw)
    clash = [reports[0], {**reports[1], "objects": {"r": 1.0}}, reports[2]]  # "r": a tensor and a JSON value
    with pytest.raises(StateMismatchError, match=r"keys \['r'\] are tensors on some ranks and JSON values"):
        assemble_manifest(3, "a", clash, **kw)


def test_slab_fast_path_and_the_leaf_by_leaf_check_agree() -> None:
    recs = [_rec([2, 0], [2, 2]), _rec([0, 0], [2, 2]), _rec([0, 0], [1, 2]), _rec([1, 0], [1, 2])]
    t, _, _ = decode_report({"a": recs[:2], "b": recs[2:]}, 32)
    t = ChunkTable.concat([t], 32)
    # "a" lists its slabs out of order: not the fast path, but a valid tiling
    assert not all_slabs([(4, 2), (2, 2)], [4, 4], [2, 2], [0, 1, 2, 3], t, check_lengths=True)
    assert all_slabs([(4, 2), (2, 2)], [4, 4], [2, 2], [1, 0, 2, 3], t, check_lengths=True)
    assert not all_slabs([(4, 2), (2, 2)], [8, 4], [2, 2], [1, 0, 2, 3], t, check_lengths=True)  # lengths
    assert not all_slabs([(4, 2), (3, 2)], [4, 4], [2, 2], [1, 0, 2, 3], t, check_lengths=True)  # coverage
    assert leaf_chunks_problem("a", [4, 2], 4, [0, 1], t) is None
    assert "cover" in str(leaf_chunks_problem("a", [6, 2], 4, [0, 1], t))
    assert "overlap" in str(leaf_chunks_problem("a", [3, 2], 4, [1, 2], t))
    assert leaf_chunks_problem("a", [4, 2], 8, [1, 0], t) is not None  # lengths of another dtype


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_two_ranks_commit_and_restore_a_table_form_checkpoint(tmp_path: Path) -> None:
    """Real ranks: reports travel in columns through the c10d store, the coordinator writes
    the chunk table, and DTensor and plain targets restore bit for bit."""
    from tests.launch import run_script

    proc = run_script(2, Path(__file__).parents[1] / "dist" / "table_worker.py", str(tmp_path), timeout_s=100)
    assert proc.returncode == 0, proc.stdout[-3000:]
    checks = read_checks(*(tmp_path / f"result-r{r}.json" for r in range(2)), output=proc.stdout)
    assert_checks(
        checks,
        [
            "the manifest is in table form",
            "sharded and plain restore",
            "per-rank value",
            "whole restore of chunks both ranks wrote",
        ],
    )


def test_overlapping_with_a_scalar_as_the_last_row() -> None:
    """Rows of no dimensions hold no box columns; looking up another leaf's chunks must not
    read past the table's box columns (the scalar's row is the last one here)."""
    recs = {
        "v": [{"file": "data/f", "offset": 0, "length": 16, "offsets": [0], "shape": [4], "digests": "a" * 32}],
        "s": [{"file": "data/f", "offset": 16, "length": 4, "offsets": [], "shape": [], "digests": "b" * 32}],
    }
    t, _, _ = decode_report(recs, 32)
    t = ChunkTable.concat([t], 32)
    lt = LeafTable(["s", "v"], ["tensor", "tensor"], ["float32", "float32"], [0, 1], [4], [1, 1], [1, 0])
    leaves = TableLeaves({}, lt, t, 1 << 20)
    assert [c.offsets for c in leaves.overlapping("v", (1,), (2,))] == [(0,)]
    assert leaves.overlapping("v", (4,), (1,)) == []
    assert [c.offset for c in leaves.overlapping("s", (), ())] == [16]
    assert leaves.head("v").shape == (4,) and leaves.head("s").shape == ()


def test_a_writers_rows_become_a_report_grouped_by_key_on_the_wire_and_off() -> None:
    """The writer hands rows in file order (a key's chunks may sit in several files); the
    report groups each key's rows, keeps the table an object for the coordinator's own report
    and sends it as JSON columns: both decode to the same records."""
    recs = {
        "a": [_rec([0, 0], [2, 2], "data/f0"), _rec([2, 0], [2, 2], "data/f1")],
        "b": [_rec([0, 0], [1, 2], "data/f0")],
    }
    f0 = ChunkTable.from_records([recs["a"][0], recs["b"][0]], 0)
    f1 = ChunkTable.from_records([recs["a"][1]], 0)
    rep = rows_report(["a", "b", "a"], ChunkTable.concat([f0, f1], 0))
    assert rep["keys"] == ["a", "b"] and rep["counts"] == [2, 1]
    wire = json.loads(json.dumps(report_for_wire(rep)))
    for form in (rep, wire, recs):
        t, keys, counts = decode_report(form, 32)
        t = ChunkTable.concat([t], 32)
        got = {}
        for k, start, n in zip(keys, [0, *itertools.accumulate(counts)], counts):
            got[k] = [t.record_json(i, 1 << 20) for i in range(start, start + n)]
        assert got == recs, form
    single = rows_report(["a", "b"], f0)
    assert single["counts"] == [1, 1] and single["table"] is f0  # no reordering: no copy
    with pytest.raises(TypeError, match="report"):
        ChunkTable.from_json(ChunkTable.concat([f0], 0).to_json(), 32).take([0])


def test_the_writer_makes_no_container_per_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 10,000 small tensors a record per chunk (a dict and two lists) made the collector
    run full collections in the writer thread every other save; the writer now keeps each
    file's chunks as columns. Counted: GC-tracked allocations (net) while writing 2,000 chunks."""
    import gc

    import shardkeeper.core.save.rank_write as saving_mod  # where the save calls it
    from shardkeeper.core import CheckpointManager

    state = {f"t{i:04d}": torch.full((3,), float(i)) for i in range(2000)}
    seen: list[int] = []
    real = saving_mod.write_shards

    def counting(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            c0 = gc.get_count()[0]
            res = real(*args, **kwargs)
            seen.append(gc.get_count()[0] - c0)
        finally:
            if was:
                gc.enable()
        return res

    monkeypatch.setattr(saving_mod, "write_shards", counting)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, state).wait()
        mgr.save(1, state).wait()
        # the first save builds the file's header (a container per entry, then freed); a save
        # of the cached plan makes only the digests' strings per chunk
        assert len(seen) == 2 and seen[1] < 200, seen
        target = {k: torch.zeros(3) for k in state}
        mgr.restore(target, step=1)
    assert_same_state(target, state)
