"""Described layouts (docs/format.md 3.8) on real gloo process groups: DTensors recorded by
their rule, their chunks in per-rank index files, saved and restored bit for bit into the
same layout, another one and plain tensors; a restore reads only the index files of the
ranks that wrote what it needs; a damaged index file is refused and reported by verify.
(The layout matrix, tests/core/restore/test_layout_matrix.py, covers both forms across every layout.)"""

from __future__ import annotations

import json

import pytest

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("described")
    out = tmp / "out"
    out.mkdir()
    res = run_workers(4, "described_worker.py", str(tmp / "root"), str(out), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(4)]


KEYS = ["m/cols", "m/few", "m/grid", "m/hsdp", "m/ids", "m/rows", "m/scalar", "m/strided", "m/sub"]


def test_dtensors_are_described_when_asked_and_enumerated_otherwise(seen: list[dict]) -> None:
    s = seen[0]
    assert (s["on version"], s["on described"], s["on enumerated"]) == ([1, ["described"]], KEYS, ["m/plain"])
    for name in ("off", "auto"):  # 9 tensors x 4 ranks: below the default's threshold
        assert (s[f"{name} version"], s[f"{name} described"]) == ([1, []], []), name
        assert s[f"{name} enumerated"] == sorted([*KEYS, "m/plain"])


@pytest.mark.parametrize("form", ["on", "off", "auto"])
@pytest.mark.parametrize("target", ["same", "other", "plain"])
def test_restores_are_bit_exact_in_every_layout(seen: list[dict], form: str, target: str) -> None:
    for s in seen:
        assert s[f"{form} {target} wrong"] == [], (s["rank"], s[f"{form} {target} wrong"])


def test_sharded_tensors_chunked_by_rank_are_described(seen: list[dict]) -> None:
    """FSDP1's ShardedTensor (dim 0 chunked over the world in rank order) follows the rule;
    the same tensor placed in reverse rank order does not, and is enumerated."""
    for s in seen:
        assert s["sharded described"] == ["chunked"], s["sharded described"]
        assert s["sharded wrong"] == [], s["sharded wrong"]


def test_a_restore_reads_only_the_index_files_it_needs(seen: list[dict]) -> None:
    for s in seen:
        # Its own shards, plus the writer of each replicated leaf (m/scalar, m/hsdp: a replica
        # chosen per key), never every rank's (the world-size sweep reads one at 16,384 ranks)
        assert 1 <= s["on same index files"] <= 3, s
        assert s["on plain index files"] == 4  # the whole tensors: every writer's
        assert s["off same index files"] == 0
    assert seen[0]["on verify"] == [] and seen[0]["off verify"] == []


def test_a_damaged_index_file_is_refused_and_reported(seen: list[dict]) -> None:
    for s in seen:
        assert s["damaged"] is not None, f"rank {s['rank']} restored from a damaged index file"
        assert "r00002-" in s["damaged"] and "of rank 2" in s["damaged"] and "step-000000000001" in s["damaged"]
        assert "restore another step" in s["damaged"]
    problems = seen[0]["damaged verify"]
    assert problems and all("of rank 2" in p for p in problems), problems


def test_incremental_saves_reference_unchanged_described_boxes(seen: list[dict]) -> None:
    for s in seen:
        assert s["inc wrong"] == [], s["inc wrong"]
    refs = seen[0]["inc references"]
    assert refs and all(p.startswith("../step-000000000001/data/") for p in refs), refs
