"""Every rank of a save must pass the same step and the options the manifest records once:
reports and outcomes carry them, and a difference fails every rank by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkeeper.core.commit.terms import SaveTerms, mismatch, ranks_text
from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers


def test_ranks_text() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_mismatch_names_each_rank_step_and_option() -> None:
    own = SaveTerms(2, {"digest": "xxh3_128"})
    assert mismatch(own, 0, {1: own, 2: SaveTerms(2, {"digest": "xxh3_128"}), 3: None}) is None
    err = mismatch(own, 0, {1: own, 2: own, 3: SaveTerms(3, {"digest": "sha256"})})
    assert err is not None and err.step == 2
    text = str(err)
    assert "step 2 on ranks 0-2; step 3 on rank 3" in text
    assert "different digest ('sha256' on rank 3; 'xxh3_128' on ranks 0-2)" in text


def test_terms_of_a_message_of_another_shape_are_none() -> None:
    assert SaveTerms.of(None) is None
    assert SaveTerms.of({"step": True, "options": {}}) is None
    assert SaveTerms.of({"step": 1, "options": []}) is None
    assert SaveTerms.of({"step": 1, "options": {"a": 1}}) == SaveTerms(1, {"a": 1})


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ranks_saving_different_steps_or_options_fail_every_rank_by_name(tmp_path: Path) -> None:
    """Before, ranks 0-2 saving step 2 and rank 3 step 3 committed step 2 and acknowledged
    rank 3's save of step 3, which never existed (with per-rank state, every rank failed
    blaming "something removed or truncated" rank 3's file)."""
    out = tmp_path / "out"
    out.mkdir()
    res = run_workers(4, "terms_worker.py", str(tmp_path / "root"), str(out), timeout_s=200)
    assert res.returncode == 0, res.stdout[-6000:]
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(4)), output=res.stdout))
