"""``import_native_checkpoint`` unpickles nothing unless ``trust_pickle is True``.

A real native DeepSpeed checkpoint (``dist/native_worker.py``: one process, ZeRO-2) whose
optimizer-states file, which DeepSpeed's converter ``ds_to_universal`` reads, also holds a
payload that creates a folder when unpickled. Every value but True (``"false"``, ``1``, ...)
is refused before the converter runs, with nothing created; True converts and imports it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.hostile_pickle import UNTRUSTED, Trace
from tests.launch import run_script

pytest.importorskip("deepspeed")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

WORKER = Path(__file__).parent / "dist" / "native_worker.py"
OPTIM = "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds-native")
    res = run_script(1, WORKER, str(out), timeout_s=180, env={"DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-4000:]
    return out / "native"


@pytest.fixture
def traced(native: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint whose optimizer states create ``trace`` when unpickled."""
    src, trace = tmp_path / "native", tmp_path / "trace"
    shutil.copytree(native, src)
    sd = torch.load(src / OPTIM, weights_only=False)  # DeepSpeed's own file, one key added
    sd["trace"] = Trace(trace)
    torch.save(sd, src / OPTIM)
    assert not trace.exists()
    return src, trace


@pytest.mark.parametrize("trust", UNTRUSTED, ids=repr)
def test_native_import_unpickles_nothing_unless_trust_is_true(
    traced: tuple[Path, Path], tmp_path: Path, trust: object
) -> None:
    from shardkeeper.deepspeed.native import import_native_checkpoint

    src, trace = traced
    root = tmp_path / "root"
    with pytest.raises(PermissionError) as refused:
        import_native_checkpoint(src, str(root), trust_pickle=trust)  # type: ignore[arg-type]
    assert not trace.exists(), f"unpickled before the refusal: {refused.value}"
    assert not root.exists()
    assert re.match(rf"{re.escape(str(src))}: .*native DeepSpeed.*trust_pickle=True", str(refused.value)), refused.value


def test_native_import_with_trust_runs_the_converter_and_imports(traced: tuple[Path, Path], tmp_path: Path) -> None:
    """The payload is live: with True the converter unpickles it, and the import works."""
    from shardkeeper.deepspeed.native import import_native_checkpoint

    src, trace = traced
    with pytest.warns(UserWarning, match="unpickling"):
        assert import_native_checkpoint(src, str(tmp_path / "root"), trust_pickle=True) == 2
    assert trace.is_dir()
    with CheckpointManager(tmp_path / "root") as mgr:
        keys = set(mgr.manifest(2).leaves)
    assert {"model/0.weight", "model/2.bias", "optim/state/0.weight/exp_avg"} <= keys, sorted(keys)
