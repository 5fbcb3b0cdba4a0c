"""The world-size benchmark keeps working: one tiny ``case_e.py`` point in process, case (e)'s
own form (run.py reads it), and ``scale.py`` with two tiny points in their own processes,
checked for structure and sanity, never for speed."""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def bench() -> Iterator[Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _scale_layout
        import case_e
        import scale

        yield case_e, scale, _scale_layout
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _check_point(p: dict[str, Any], ranks: int, tensors: int) -> None:
    assert "status" not in p, p
    assert (p["ranks"], p["tensors"], p["chunks"]) == (ranks, tensors, ranks * tensors)
    for k in ("manifest_bytes", "store_bytes", "dcp_metadata_bytes", "store_round_trips"):
        assert isinstance(p[k], int) and p[k] > 0, k
    for k in ("commit_s", "plan_s", "dcp_unpickle_s", "dcp_plan_s"):
        assert isinstance(p[k], float) and p[k] > 0, k
    phases = p["store_round_trips_by_phase"]
    assert sum(sum(ph.values()) for ph in phases.values()) == p["store_round_trips"]
    # a report and a count per rank, one wake; rank 0 collects in three round trips at any world size
    deletes = {"delete_key": ranks - 1} if p["repeats"] > 1 else {}  # each rank's previous report
    assert phases["report"] == {"set": ranks, "add": ranks - 1, **deletes}
    assert phases["collect"] == {"wait": 1, "add": 1, "multi_get": 1}
    assert p["overlaps"] == tensors  # rank 0's shard of every tensor lies in exactly one chunk
    assert p["dcp_plan_items"] == tensors


def test_one_point_measures_both_formats_of_the_same_chunks(bench: Any, tmp_path: Path) -> None:
    case_e, _, _ = bench
    p = case_e.measure_point(tmp_path, 3, 40, "sharded", 1)  # 1024 rows over 3 ranks: 342, 342, 340
    _check_point(p, 3, 40)
    with open(tmp_path / "dcp-sharded-3x40.metadata", "rb") as f:  # our own file, written by the benchmark
        md = pickle.load(f)
    assert len(md.state_dict_metadata) == 40 and len(md.storage_data) == 3 * 40
    for tmd in md.state_dict_metadata.values():
        assert [c.sizes[0] for c in tmd.chunks] == [342, 342, 340] and tmd.size == torch.Size([1024, 256])


def test_rows_split_as_torch_chunk_does(bench: Any) -> None:
    _, _, layout = bench
    for rows, ranks in ((1024, 8), (1024, 3), (1024, 1000), (2048, 2048), (7, 3)):
        want = [len(c) for c in torch.arange(rows).chunk(ranks)]
        got = [layout.row_split(rows, ranks, r)[1] for r in range(ranks)]
        assert [n for n in got if n] == want and sum(got) == rows


def test_case_e_keeps_the_keys_run_py_reads(bench: Any, tmp_path: Path) -> None:
    case_e, _, _ = bench
    res = case_e.measure_manifest_scale(tmp_path, n_tensors=16, n_ranks=8)
    _check_point(res, 8, 16)
    assert res["whole"]["chunks"] == 16 and res["whole"]["manifest_bytes"] > 0
    assert isinstance(res["whole"]["commit_s"], float) and isinstance(res["whole"]["plan_s"], float)


def test_sweep_writes_every_point_and_its_table(bench: Any, tmp_path: Path) -> None:
    _, scale, _ = bench
    out = scale.main(["--ranks", "2,4", "--tensors", "20", "--extra", "", "--out-dir", str(tmp_path), "--name", "s"])
    doc = json.loads(out.read_text())
    assert [(p["ranks"], p["tensors"]) for p in doc["points"]] == [(2, 20), (4, 20)]
    for p in doc["points"]:
        _check_point(p, p["ranks"], 20)
    md = (tmp_path / "s.md").read_text()
    assert "| 2 | 20 | 40 |" in md and "| 4 | 20 | 80 |" in md
