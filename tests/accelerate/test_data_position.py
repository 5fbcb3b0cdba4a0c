"""A real Accelerator(cpu=True) loop saved mid-epoch on 2 gloo ranks (torchrun) resumes on 1:
over the epoch every sample is seen exactly once.

``dist/data_worker.py first`` (2 ranks) calls ``save_state()`` after step 3 of a 6-step epoch
and trains on to step 5 (lost work); ``second`` (1 rank) calls ``load_state()``, finishes the
epoch and trains the next. The indices trained on in the epoch (steps 1-3 of the first run, the
rest in the second) are the dataset, each once; the next epoch is all of it once; parameters
and optimizer state come back bit for bit. Once with a plain shuffled DataLoader (Accelerate's
synchronized generator), once with a sampler of the user's own (a seeded permutation per epoch).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "data_worker.py"
N, SAVED_STEP = 48, 3


def _ids(out: Path, phase: str, world: int) -> list[list[list[Any]]]:
    return [json.loads((out / f"{phase}-ids-r{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["shuffle", "own"])
def test_a_loop_saved_mid_epoch_at_two_ranks_resumes_at_one_every_sample_once(tmp_path: Path, kind: str) -> None:
    first = run_script(2, WORKER, "first", str(tmp_path), kind, timeout_s=90, torchrun=True)
    assert first.returncode == 0, first.stdout[-4000:]
    second = run_script(1, WORKER, "second", str(tmp_path), kind, timeout_s=90, torchrun=True)
    assert second.returncode == 0, second.stdout[-4000:]
    assert_checks(
        read_checks(tmp_path / "second-r0.json", output=second.stdout),
        ["restored the saved step", "parameters and optimizer state restored bit for bit"],
        where="2 -> 1",
    )
    before = [ids for rank in _ids(tmp_path, "first", 2) for _, step, ids in rank if step <= SAVED_STEP]
    (after,) = _ids(tmp_path, "second", 1)
    rest = [ids for p, _, ids in after if p == 0]
    seen = Counter(i for ids in before + rest for i in ids)
    assert sorted(seen) == list(range(N)), f"skipped: {sorted(set(range(N)) - set(seen))}"
    assert [i for i, c in seen.items() if c > 1] == [], "duplicated"
    assert len(rest) == 6  # 24 samples left, in batches of 4 on the one rank
    assert sorted(i for p, _, ids in after if p == 1 for i in ids) == list(range(N))  # the next epoch, whole
