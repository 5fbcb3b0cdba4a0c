"""The GIL benchmark keeps working: a tiny run of both shardkeeper writers through its own
launch, checked for structure and sanity, never for speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_a_tiny_run_writes_each_writers_figures(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gil
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    argv = ["--size-mib", "4", "--repeats", "1", "--writers", "sk_thread,sk_process", "--tag", "t1"]
    argv += ["--sk-options", '{"io_threads": 1}', "--results-dir", str(tmp_path), "--workdir", str(tmp_path)]
    assert gil.main([*argv, "--timeout-s", "90"]) == 0
    (doc_file,) = tmp_path.glob("gil-*-t1.json")
    doc = json.loads(doc_file.read_text())
    assert doc["errors"] == {} and not doc["partial"] and isinstance(doc["target_met"], bool)
    assert doc["info"]["state_bytes"] == 4 << 20 and doc["info"]["sk_options"] == '{"io_threads": 1}'
    assert sorted(doc["writers"]) == ["sk_process", "sk_thread"]
    for w in doc["writers"].values():
        assert w["rounds"] == 1 and w["save_s"] > 0 and w["base_iters_per_s"] > 0 and w["kept"] > 0
        assert w["base_loop_sleeps_per_s"] >= 0 and w["during_loop_sleeps_per_s"] >= 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sk-gil-")] == []  # the work dir is gone
    md = doc_file.with_suffix(".md").read_text()
    assert "| sk_thread |" in md and "| sk_process |" in md and "Target:" in md and "sleeps/s" in md
    assert '`{"io_threads": 1}`' in md


def test_options_that_are_not_a_json_object_are_refused_before_any_run(tmp_path: Path, capsys: Any) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gil
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with pytest.raises(SystemExit) as e:
        gil.main(["--sk-options", "[1]", "--results-dir", str(tmp_path), "--workdir", str(tmp_path)])
    assert e.value.code == 2 and "--sk-options must be a JSON object" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
