"""``import_accelerate_checkpoint`` unpickles nothing unless ``trust_pickle is True``.

A folder from Accelerate's own ``save_state`` holding any file, at any depth, that may be
unpickled (anything but ``*.safetensors``, ``*.json``, ``*.txt``, ``latest``) is refused for
every other value, with ``PermissionError``, before Accelerate's loader runs:

- in this process, a plain CPU Accelerator's folder (``optimizer.bin``, ``*.pkl``): the
  prepared objects stay untouched;
- in one worker process (``dist/import_worker.py``), Accelerate with DeepSpeed, whose folder's
  only pickles are DeepSpeed's ``pytorch_model/*.pt`` (read with full unpickling), one of them
  holding a payload that creates a folder: nothing is created until True, which imports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checks import assert_checks, read_checks
from tests.hostile_pickle import UNTRUSTED
from tests.launch import run_script

accelerate = pytest.importorskip("accelerate")

import shardkeeper.accelerate as ska  # noqa: E402
from tests.accelerate._native import native_folder  # noqa: E402

WORKER = Path(__file__).parent / "dist" / "import_worker.py"


def test_plain_folder_is_refused_before_accelerate_loads_it(tmp_path: Path) -> None:
    acc, model, opt, folder = native_folder(tmp_path, "checkpoint_3")
    ska.enable(acc, root=str(tmp_path / "sk"), async_save=False)
    with torch.no_grad():
        model.weight.zero_()
    opt.optimizer.state.clear()
    for trust in UNTRUSTED:
        with pytest.raises(PermissionError) as refused:
            ska.import_accelerate_checkpoint(acc, str(folder), trust_pickle=trust)  # type: ignore[arg-type]
        assert not model.weight.any() and not opt.optimizer.state, f"loaded with trust_pickle={trust!r}"
        msg = str(refused.value)
        assert msg.startswith(f"{folder}: ") and "optimizer.bin" in msg and "trust_pickle=True" in msg, msg
    assert not (tmp_path / "sk").exists()
    acc.end_training()


@pytest.mark.multiprocess
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_deepspeed_subfolder_pickles_need_trust(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")  # Accelerate's DeepSpeed integration imports it
    res = run_script(1, WORKER, str(tmp_path), timeout_s=180, env={"DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-4000:]
    want = (
        [f"refused {t!r}" for t in UNTRUSTED]
        + [f"nothing unpickled with {t!r}" for t in UNTRUSTED]
        + [
            "folder_as_written",
            "nothing saved while refused",
            "trusted import runs DeepSpeed's loader",
            "trusted import commits the step",
            "imported keys",
        ]
    )
    assert_checks(read_checks(tmp_path / "results.json", output=res.stdout), want)
