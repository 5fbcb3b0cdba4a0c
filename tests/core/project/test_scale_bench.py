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

ROOT = Path(__file__).resolve().parents[3]

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


def _check_point(p: dict[str, Any], ranks: int, tensors: int, dcp: bool = True) -> None:
    assert "status" not in p, p
    assert (p["ranks"], p["tensors"], p["chunks"]) == (ranks, tensors, ranks * tensors)
    for k in ("manifest_bytes", "store_bytes", "store_round_trips", *(("dcp_metadata_bytes",) if dcp else ())):
        assert isinstance(p[k], int) and p[k] > 0, k
    for k in ("commit_s", "plan_s", *(("dcp_unpickle_s", "dcp_plan_s") if dcp else ())):
        assert isinstance(p[k], float) and p[k] > 0, k
    phases = p["store_round_trips_by_phase"]
    assert sum(sum(ph.values()) for ph in phases.values()) == p["store_round_trips"]
    # a report and a count per rank, one wake; rank 0 collects in three round trips at any world size
    deletes = {"delete_key": ranks - 1} if p["repeats"] > 1 else {}  # each rank's previous report
    assert phases["report"] == {"set": ranks, "add": ranks - 1, **deletes}
    assert phases["collect"] == {"wait": 1, "add": 1, "multi_get": 1}
    assert p["overlaps"] == tensors  # rank 0's shard of every tensor lies in exactly one chunk
    assert not dcp or p["dcp_plan_items"] == tensors


def test_one_point_measures_both_formats_of_the_same_chunks(bench: Any, tmp_path: Path) -> None:
    case_e, _, _ = bench
    p = case_e.measure_point(tmp_path, 3, 40, "sharded", 1)  # 1024 rows over 3 ranks: 342, 342, 340
    _check_point(p, 3, 40)
    with open(tmp_path / "dcp-sharded-3x40.metadata", "rb") as f:  # our own file, written by the benchmark
        md = pickle.load(f)
    assert len(md.state_dict_metadata) == 40 and len(md.storage_data) == 3 * 40
    for tmd in md.state_dict_metadata.values():
        assert [c.sizes[0] for c in tmd.chunks] == [342, 342, 340] and tmd.size == torch.Size([1024, 256])


def test_a_described_point_plans_from_rank_0s_index_file(bench: Any, tmp_path: Path) -> None:
    """The rule's form of the same chunks: the manifest lists no chunk, rank 0 plans the same
    overlaps from its index file, and DCP's figures are of the enumerated chunks."""
    case_e, _, _ = bench
    p = case_e.measure_point(tmp_path, 3, 40, "described", 1)
    _check_point(p, 3, 40)
    e = case_e.measure_point(tmp_path, 3, 40, "sharded", 1, dcp_repeats=0)
    assert p["dcp_metadata_bytes"] > 0 and p["reads"] == e["reads"]
    man = json.loads((tmp_path / "described-3x40" / "step-000000000001" / "manifest.json").read_text())
    assert (
        man["requires"] == ["described"] and len(man["described"]["keys"]) == 40 and man["chunk_table"]["offset"] == []
    )


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
    assert res["described"]["chunks"] == 8 * 16 and res["described"]["plan_s"] > 0


def test_sweep_writes_every_point_and_its_table(bench: Any, tmp_path: Path) -> None:
    _, scale, _ = bench
    argv = ["--ranks", "2,4", "--tensors", "20", "--extra", "", "--out-dir", str(tmp_path), "--name", "s"]
    out = scale.main([*argv, "--dcp-max-chunks", "50"])
    doc = json.loads(out.read_text())
    got = [(p["layout"], p["ranks"], p["tensors"]) for p in doc["points"]]
    assert got == [("described", 2, 20), ("described", 4, 20), ("sharded", 2, 20), ("sharded", 4, 20)]
    for p in doc["points"]:  # DCP beside the first layout's points, up to --dcp-max-chunks
        _check_point(p, p["ranks"], 20, dcp=p["layout"] == "described" and p["ranks"] == 2)
    assert "dcp_note" in doc["points"][1] and "dcp_metadata_bytes" not in doc["points"][3]
    md = (tmp_path / "s.md").read_text()
    assert "| described | 2 | 20 | 40 |" in md and "| sharded | 4 | 20 | 80 |" in md


def test_ratio_pairs_alternate_64_ranks_and_the_largest_point(bench: Any, tmp_path: Path) -> None:
    """``--pairs``: the targets' ratios to 64 ranks, from points run alternately (a drifting
    machine skews points run minutes apart), each ratio that of the two points' own figures."""
    _, scale, _ = bench
    argv = ["--ranks", "8,72", "--tensors", "3", "--extra", "", "--layouts", "described", "--pairs", "2"]
    out = scale.main([*argv, "--repeats", "1", "--out-dir", str(tmp_path), "--name", "r", "--dcp-max-chunks", "0"])
    r = json.loads(out.read_text())["ratios"]
    assert (r["base_ranks"], r["top_ranks"], len(r["pairs"])) == (64, 72, 2)
    for p in r["pairs"]:
        assert (p["base"]["ranks"], p["top"]["ranks"]) == (64, 72) and "dcp_plan_s" not in p["top"]
        for k in ("commit_min", "plan_min", "commit", "plan", "manifest"):
            src = "manifest_bytes" if k == "manifest" else f"{k}_s"
            assert p[f"{k}_ratio"] == pytest.approx(p["top"][src] / p["base"][src])
    assert r["median"]["commit_min_ratio"] == pytest.approx(
        sorted(p["commit_min_ratio"] for p in r["pairs"])[0] / 2
        + sorted(p["commit_min_ratio"] for p in r["pairs"])[1] / 2
    )
    md = (tmp_path / "r.md").read_text()
    assert "## Ratios, 72 to 64 ranks" in md and "| median |" in md


@pytest.mark.parametrize("layout", ["described", "sharded"])
def test_a_point_above_the_group_size_commits_in_groups(bench: Any, tmp_path: Path, layout: str) -> None:
    case_e, _, _ = bench
    # rank 0 alone, then groups of 128, 128 and 3 ranks
    p = case_e.measure_point(tmp_path, 260, 3, layout, 1, dcp_repeats=0)
    # 1,024 rows by torch's chunk rule over 260 ranks: 256 ranks of 4 rows, 4 ranks of none
    assert p["group_ranks"] == 128 and p["leader_fold_s"] > 0 and p["chunks"] == 256 * 3
    man = json.loads((tmp_path / f"{layout}-260x3" / "step-000000000001" / "manifest.json").read_text())
    if layout == "described":  # the ranks' records in four pages, the ranks' mesh by its first rank
        pages = man["described"]["pages"]
        assert man["requires"] == ["described", "pages"] and pages["count"] == [1, 128, 128, 3]
        assert pages["first"] == [0, 1, 129, 257]
        assert man["described"]["meshes"] == [{"shape": [260], "first_rank": 0}]
        assert p["reads"] >= 1 and p["overlaps"] == 3
    else:  # no described leaves: folded reports, no pages
        assert "requires" not in man and "described" not in man
