"""Accelerate's "start from pretrained" path as docs/api.md gives it: ``load_hf`` into the
model ``accelerator.prepare`` returned (unwrapped), on 2 gloo ranks, from transformers' own
``save_pretrained`` folders of a tiny GPT-2 and a tiny Llama, bit for bit against
``from_pretrained`` in one process (``dist/hf_load_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.checks import assert_checks, read_checks  # noqa: E402
from tests.hf_models import MODELS, save  # noqa: E402
from tests.launch import run_script  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "hf_load_worker.py"


def test_the_prepared_model_starts_from_a_save_pretrained_folder(tmp_path: Path) -> None:
    for kind in MODELS:
        save(kind, tmp_path / "hf" / kind)
    res = run_script(2, WORKER, str(tmp_path / "hf"), str(tmp_path / "results"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(2)), output=res.stdout)
    expected = ["the distributed type is MULTI_CPU"]
    expected += [
        f"{k}: {e}" for k in MODELS for e in ("the prepared model bit for bit against from_pretrained", "trains a step")
    ]
    assert_checks(checks, expected)
