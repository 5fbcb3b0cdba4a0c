"""``load_hf`` of transformers' own ``save_pretrained`` folders (a tiny GPT-2 and a tiny Llama,
several shards each) into sharded models on gloo ranks: FSDP2 at world sizes 2 and 3, tensor
parallel at 2, a renamed and a dtype-cast load, a truncated and a forged shard; and the
Trainer's documented ``model_init``. Every load is compared bit for bit with
``from_pretrained`` in one process; the bytes read are counted (``dist/hf_load_worker.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.checks import assert_checks, read_checks  # noqa: E402
from tests.hf_models import MODELS, save  # noqa: E402
from tests.launch import run_script  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "hf_load_worker.py"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    for kind in MODELS:
        save(kind, out / kind)
    return out


def _run(folders: Path, out: Path, world: int, parts: list[str], expected: list[str]) -> None:
    res = run_script(world, WORKER, str(folders), str(out), ",".join(parts), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    name = "+".join(parts)
    checks = read_checks(*(out / f"{name}-w{world}-r{r}.json" for r in range(world)), output=res.stdout)
    assert_checks(checks, [e.format(kind=k) for e in expected for k in MODELS])
    print("\n".join(line for line in res.stdout.splitlines() if line.startswith("hf_load")))


def test_two_ranks_fsdp2_tp_renamed_cast_and_corrupt(folders: Path, tmp_path: Path) -> None:
    expected = [
        "fsdp2 {kind}: bit for bit against from_pretrained",
        "fsdp2 {kind}: bytes read <= 1.1 x the rank's share",
        "fsdp2 {kind}: bytes read over the ranks <= 1.1 x the model",
        "tp {kind}: the projections are DTensors",
        "tp {kind}: bit for bit against from_pretrained",
        "tp {kind}: bytes read over the ranks <= 1.1 x the model",
        "rename {kind}: the base model bit for bit",
        "cast {kind}: bfloat16 bit for bit against from_pretrained(dtype=bfloat16)",
        "corrupt truncated: a clear error",
        "corrupt truncated: nothing was written into the model",
        "corrupt forged: a clear error",
        "corrupt forged: nothing was written into the model",
    ]
    _run(folders, tmp_path, 2, ["fsdp2", "tp", "rename", "cast", "corrupt"], expected)


def test_three_ranks_fsdp2(folders: Path, tmp_path: Path) -> None:
    expected = [
        "fsdp2 {kind}: bit for bit against from_pretrained",
        "fsdp2 {kind}: bytes read <= 1.1 x the rank's share",
        "fsdp2 {kind}: bytes read over the ranks <= 1.1 x the model",
    ]
    _run(folders, tmp_path, 3, ["fsdp2"], expected)


def test_the_trainers_documented_model_init_starts_from_the_folder(folders: Path, tmp_path: Path) -> None:
    expected = [
        "trainer {kind}: model_init's model bit for bit against from_pretrained",
        "trainer {kind}: train() starts from the pretrained weights",
        "trainer {kind}: and trains",
    ]
    _run(folders, tmp_path, 2, ["trainer"], expected)
