"""``shardkeeper.deepspeed.load_pretrained``: DeepSpeed ZeRO-3 engines (fp32 and bf16, 2 gloo
ranks on CPU) started from transformers' own ``save_pretrained`` folders of a tiny GPT-2 and a
tiny Llama (several shards), bit for bit against ``from_pretrained`` in one process, reading
at most 1.1 x the folder's tensors over the ranks (``dist/hf_load_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.checks import assert_checks, read_checks  # noqa: E402
from tests.hf_models import MODELS, save  # noqa: E402
from tests.launch import run_script  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "hf_load_worker.py"


def test_zero3_engines_start_from_save_pretrained_folders(tmp_path: Path) -> None:
    folders = tmp_path / "hf"
    for kind in MODELS:
        save(kind, folders / kind)
        save(kind, folders / f"{kind}-bf16", dtype=torch.bfloat16)
    res = run_script(2, WORKER, str(folders), str(tmp_path / "results"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(2)), output=res.stdout)
    expected = [
        "zero3 {dtype} {kind}: fp32 masters bit for bit against from_pretrained",
        "zero3 {dtype} {kind}: module weights bit for bit against from_pretrained",
        "zero3 {dtype} {kind}: bytes read over the ranks <= 1.1 x the model",
        "zero3 bf16-folder {kind}: without dtype=True, a clear error",
        "zero3 bf16-folder {kind}: dtype=True casts into the fp32 masters exactly",
    ]
    assert_checks(checks, [e.format(dtype=d, kind=k) for e in expected for d in ("fp32", "bf16") for k in MODELS])
    print("\n".join(line for line in res.stdout.splitlines() if line.startswith("hf_load")))
