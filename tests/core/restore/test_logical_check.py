"""The restore's check of what it assembled against the recorded logical digests.

Each fault goes in through the planner's test hook (``restore.plan.FAULT``), so the bytes
read still pass their chunk digests and only the placement is wrong: a piece put at a wrong
offset, two pieces swapped, one piece left out (its target keeps zeros). Each is caught and
named; ``restore()`` falls back to the previous step (an explicit step raises), ``load()``
raises; ``logical_check="warn"`` restores with a warning and a metric, ``"off"`` records
and checks nothing. At 2 ranks (``dist/logical_check_worker.py``): a piece left out on one
rank of a sharded DTensor is found by the exchange, on both ranks, and both fall back.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError, metrics
from shardkeeper.core.format.logical_member import digests_of
from shardkeeper.core.restore import plan as restore_plan
from shardkeeper.core.restore.plan import RestorePlan, overlap_ops
from shardkeeper.core.state.chunks import Piece

from .._launch import run_workers


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8, 6, generator=g), "b": torch.randn(8, 6, generator=g), "c": torch.randn(5, generator=g)}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state(0).items()}


def _shift(plan: RestorePlan) -> None:
    """Tensor ``a`` placed one row off: rows 1..7 of its chunk land on rows 0..6."""
    op = next(o for o in plan.ops if o.key == "a")
    plan.ops.remove(op)
    dest = op.dest
    plan.ops.extend(overlap_ops("a", Piece((1, 0), (7, 6), dest[:7]), op.chunk, op.dtype, 4, 1 << 30))


def _swap(plan: RestorePlan) -> None:
    """Tensors ``a`` and ``b`` (same shape) each filled with the other's bytes."""
    a = next(o for o in plan.ops if o.key == "a")
    b = next(o for o in plan.ops if o.key == "b")
    a.dest, b.dest = b.dest, a.dest


def _drop(plan: RestorePlan) -> None:
    """Tensor ``c``'s piece left out: it keeps the target's zeros."""
    plan.ops[:] = [o for o in plan.ops if o.key != "c"]


FAULTS: dict[str, tuple[Callable[[RestorePlan], None], set[str]]] = {
    "offset": (_shift, {"a"}),
    "swap": (_swap, {"a", "b"}),
    "zeroed": (_drop, {"c"}),
}


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[RestorePlan], None], int], None]]:
    """``fault(fn, times)``: apply ``fn`` to the next ``times`` plans."""

    def arm(fn: Callable[[RestorePlan], None], times: int = 1) -> None:
        left = [times]

        def hook(plan: RestorePlan) -> None:
            if left[0] > 0:
                left[0] -= 1
                fn(plan)

        monkeypatch.setattr(restore_plan, "FAULT", hook)

    yield arm


def _saved(root: Path, **options: object) -> CheckpointManager:
    mgr = CheckpointManager(root, async_save=False, **options)  # type: ignore[arg-type]
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    return mgr


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_misplaced_piece_is_caught_named_and_restore_falls_back(tmp_path: Path, fault, name: str) -> None:
    fn, keys = FAULTS[name]
    mgr = _saved(tmp_path / "root")
    fault(fn)
    target = _zeros()
    with pytest.warns(UserWarning, match=r"step 2 .* is damaged") as caught:
        assert mgr.restore(target) == 1
    said = " ".join(str(w.message) for w in caught)
    for k in keys:
        assert f"tensor {k!r}" in said and "logical digest" in said, said
    for k, v in _state(1).items():  # the fallback rewrote every key, bit for bit
        assert torch.equal(target[k], v), k
    assert 2 in mgr.steps()  # intact files: not quarantined


def test_a_recorded_digest_that_is_not_the_steps_is_quarantined_and_saved_again(tmp_path: Path) -> None:
    """A manifest whose recorded digest is not its tensor's (a writer bug, an edited manifest):
    restore falls back, ``verify --logical`` proves it, so the step is quarantined and the run
    saves it again (before, ``save(2)`` was refused as committed and ``delete --damaged``
    found nothing to delete)."""
    mgr = _saved(tmp_path / "root")
    path = next((tmp_path / "root").glob("step-*2/manifest.json"))
    doc = json.loads(path.read_text())
    d = doc["logical"]["digests"]
    doc["logical"]["digests"] = ("0" if d[0] != "0" else "1") + d[1:]
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"step 2 .* quarantined"):
        assert mgr.restore(_zeros()) == 1
    assert mgr.steps() == [1]
    mgr.save(2, _state(2))
    assert mgr.restore(_zeros()) == 2


def test_an_asked_step_that_assembles_wrong_raises_naming_the_tensor(tmp_path: Path, fault) -> None:
    mgr = _saved(tmp_path / "root")
    fault(_shift)
    with pytest.raises(CorruptCheckpointError, match=r"step 2 .*tensor 'a' .*logical digest .*logical_check='warn'"):
        mgr.restore(_zeros(), step=2)


def test_a_clean_restore_passes_the_check_and_counts_what_it_checked(tmp_path: Path) -> None:
    mgr = _saved(tmp_path / "root")
    digests = digests_of(mgr.manifest(2).logical, mgr.manifest(2).leaves)
    assert digests is not None and all(digests[k] for k in "abc")
    target = _zeros()
    assert mgr.restore(target) == 2
    stats = mgr.last_restore_stats
    assert stats is not None and stats.logical is not None
    assert stats.logical.checked == 3 and not stats.logical.problems and not stats.logical.skipped
    for k, v in _state(2).items():
        assert torch.equal(target[k], v)


def test_load_checks_what_it_assembled(tmp_path: Path, fault) -> None:
    mgr = _saved(tmp_path / "root")
    fault(_swap)
    with pytest.raises(CorruptCheckpointError, match=r"load\(\) of step 2 .*tensor 'a'"):
        mgr.load()
    out = mgr.load()  # the hook fired once: a clean load passes
    assert torch.equal(out["a"], _state(2)["a"])


def test_warn_restores_with_a_warning_and_a_metric(tmp_path: Path, fault, caplog: pytest.LogCaptureFixture) -> None:
    mgr = _saved(tmp_path / "root", logical_check="warn")
    before = _counted()
    fault(_drop)
    with caplog.at_level(logging.WARNING):
        assert mgr.restore(_zeros()) == 2
    assert any("tensor 'c'" in r.getMessage() and "logical_check='warn'" in r.getMessage() for r in caplog.records)
    assert _counted() == before + 1


def _counted() -> float:
    return metrics.LOGICAL_MISMATCHES.total()


def test_off_records_no_digest_and_checks_nothing(tmp_path: Path, fault) -> None:
    mgr = _saved(tmp_path / "root", logical_check="off")
    manifest = mgr.manifest(2)
    assert manifest.logical is None and digests_of(manifest.logical, manifest.leaves) is None
    fault(_drop)
    assert mgr.restore(_zeros()) == 2  # not checked: the misplacement goes through
    stats = mgr.last_restore_stats
    assert stats is not None and stats.logical is None


def test_a_cast_restore_is_skipped_not_failed(tmp_path: Path) -> None:
    mgr = _saved(tmp_path / "root")
    target = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in _state(0).items()}
    assert mgr.restore(target, cast_dtypes=True) == 2
    stats = mgr.last_restore_stats
    assert stats is not None and stats.logical is not None
    assert sorted(stats.logical.skipped) == ["a", "b", "c"] and stats.logical.checked == 0


@pytest.mark.multiprocess
def test_two_ranks_find_a_piece_left_out_on_one_of_them(tmp_path: Path) -> None:
    res = run_workers(2, "logical_check_worker.py", str(tmp_path / "root"), str(tmp_path), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for r, g in enumerate(got):
        assert g["restored"] == 1, (r, g)
        assert "tensor 'w'" in g["warning"] and "logical digest" in g["warning"], (r, g)
        assert g["equal"], (r, g)
        assert g["checked_ok"], (r, g)
    assert math.isclose(got[0]["sum"], got[1]["sum"])
