"""Lightning's "start from pretrained" path as docs/api.md gives it: ``load_hf`` at the end of
``configure_model``, after ``fully_shard`` under ``ModelParallelStrategy`` (2 gloo ranks), from
transformers' own ``save_pretrained`` folder of a tiny Llama, bit for bit against
``from_pretrained`` in one process at the start of ``fit`` (``dist/hf_load_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.checks import assert_checks, read_checks  # noqa: E402
from tests.hf_models import save  # noqa: E402
from tests.launch import run_script  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "hf_load_worker.py"


def test_configure_model_starts_the_sharded_model_from_a_save_pretrained_folder(tmp_path: Path) -> None:
    folder = save("llama", tmp_path / "hf")
    res = run_script(2, WORKER, str(folder), str(tmp_path / "results"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(2)), output=res.stdout)
    expected = [
        "configure_model sharded the parameters",
        "the sharded model at fit's start bit for bit against from_pretrained",
        "it trains a step",
    ]
    assert_checks(checks, expected)
