"""Per-rank state at another world size, plain torch on real gloo ranks (dist/world_change_worker.py).

The default (``per_rank="map"``) resumes 2 -> 1 and 1 -> 2: model and optimizer bit for bit,
rank r takes saved rank r's RNG and per-rank state, a rank the saving run did not have keeps
its own, and rank 0 alone warns once, naming the state, how it was mapped, both world sizes
and the step. ``per_rank="exact"`` refuses, naming the step, both world sizes and where
``per_rank`` is set. Bad values name that place too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from shardkeeper.core import CheckpointManager, PerRank
from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parents[1] / "dist" / "world_change_worker.py"


def _run(nproc: int, out: Path, *args: str) -> None:
    proc = run_script(nproc, WORKER, *args, timeout_s=120, torchrun=nproc > 1)
    assert proc.returncode == 0, proc.stdout[-4000:]


def _got(out: Path, world: int, policy: str | None, rank: int) -> dict[str, Any]:
    return cast("dict[str, Any]", json.loads((out / f"resume-{world}-{policy}-{rank}.json").read_text()))


@pytest.mark.timeout(300)
def test_saved_on_two_resumes_on_one_by_default_and_exact_refuses(tmp_path: Path) -> None:
    _run(2, tmp_path, "save", str(tmp_path))
    _run(1, tmp_path, "resume", str(tmp_path))
    got = _got(tmp_path, 1, None, 0)
    assert got["error"] is None and got["step"] == 5, got
    assert got["bit_exact"] and got["rng_from"] == 0 and got["own_from"] == 0, got
    assert len(got["warnings"]) == 1, got
    w = got["warnings"][0]
    assert w.startswith("WorldSizeChangedWarning: step 5 under "), w
    for part in ("saved at world size 2", "restored at world size 1", "'rng', 'own'", "rank 0 took the saved state"):
        assert part in w, (part, w)
    assert "the saved state of rank 1 is not used" in w and "CheckpointManager(root, per_rank=...)" in w, w

    _run(1, tmp_path, "resume", str(tmp_path), "exact")
    err = _got(tmp_path, 1, "exact", 0)["error"]
    assert err is not None and err.startswith("StateMismatchError: per-rank state"), err
    for part in (
        "(step 5, rank 0)",
        "saved at world size 2, restoring at 1",
        "per_rank='exact'",
        "CheckpointManager(root, per_rank=...) or mgr.restore(..., per_rank=...)",
        "'map'",
    ):
        assert part in err, (part, err)


@pytest.mark.timeout(300)
def test_saved_on_one_resumes_on_two_by_default(tmp_path: Path) -> None:
    _run(1, tmp_path, "save", str(tmp_path))
    _run(2, tmp_path, "resume", str(tmp_path))
    r0, r1 = _got(tmp_path, 2, None, 0), _got(tmp_path, 2, None, 1)
    assert r0["error"] is None and r1["error"] is None and r0["step"] == r1["step"] == 5, (r0, r1)
    assert r0["bit_exact"] and r1["bit_exact"], (r0, r1)
    assert (r0["rng_from"], r0["own_from"]) == (0, 0), r0
    assert (r1["rng_from"], r1["own_from"]) == ("own", "own"), r1  # never a copy of rank 0's stream
    assert len(r0["warnings"]) == 1 and not r1["warnings"], (r0, r1)  # once, on rank 0
    assert "rank 1 kept their own (the saving run had no such rank)" in r0["warnings"][0], r0


def test_a_bad_policy_names_the_plain_torch_call(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"own": PerRank(torch.ones(2))})
        with pytest.raises(
            ValueError,
            match=r"per_rank='nope'; choose one of map, exact, modulo, drop \(set it in "
            r"CheckpointManager\(root, per_rank=\.\.\.\) or mgr\.restore\(\.\.\., per_rank=\.\.\.\)\)",
        ):
            mgr.restore({"own": PerRank(torch.zeros(2))}, per_rank="nope")


def test_the_note_names_each_policy_s_mapping() -> None:
    from shardkeeper.core.restore.per_rank import PER_RANK_POLICIES, WorldSizeChangedWarning, world_change_note

    assert PER_RANK_POLICIES[0] == "map"
    grow = world_change_note(["rng"], saved_world=2, world=4, policy="map", step=7, root="/r", call="X(per_rank=...)")
    assert "ranks 0-1 took the saved state of the same rank; ranks 2-3 kept their own" in grow, grow
    # a global data position (the samplers', every adapter's) does continue exactly: not denied
    assert "a data position that shardkeeper's samplers or an adapter saved" in grow, grow
    assert "data positions kept per rank do not continue" in grow, grow
    assert "saved rank r % 2's" in world_change_note(
        ["rng"], saved_world=2, world=3, policy="modulo", step=7, root="/r", call="X(per_rank=...)"
    )
    assert "every rank kept its own" in world_change_note(
        ["rng"], saved_world=2, world=1, policy="drop", step=7, root="/r", call="X(per_rank=...)"
    )
    assert issubclass(WorldSizeChangedWarning, UserWarning)
