"""The layout matrix: {plain/DDP, FSDP1 sharded, FSDP2, TP, FSDP2+TP, ZeRO-style flat
``Fragment`` partitions} saved at world sizes 2, 3 and 4, restored into every layout at world sizes 1, 2, 3 and 4, on real gloo process
groups. Parameters and AdamW state must match the saved run bit for bit; where layout and
world size are the saver's, one more training step must give the uninterrupted run's loss.

(FSDP2+TP needs a 2-D mesh, so it runs at world size 4.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("matrix")
    for world in (2, 3, 4):
        res = run_workers(world, "worker.py", "save", str(root))
        assert res.returncode == 0, res.stdout[-4000:]
    return root


def _checks(root: Path, phase: str, world: int, output: str = "") -> list[dict]:
    return read_checks(*sorted((root / "results").glob(f"{phase}-w{world}-r*.json")), output=output)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_saves_commit_under_every_layout(matrix_root: Path, world: int) -> None:
    assert_checks(_checks(matrix_root, "save", world), where=f"save at world size {world}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_restore_every_checkpoint_into_every_layout(matrix_root: Path, world: int) -> None:
    res = run_workers(world, "worker.py", "restore", str(matrix_root))
    if res.returncode != 0:  # say whether the ranks got through their checks (a crash at exit?)
        files = sorted((matrix_root / "results").glob(f"restore-w{world}-r*.json"))
        failed = [c["name"] for c in (read_checks(*files) if files else []) if not c["ok"]]
        pytest.fail(
            f"exit code {res.returncode}; results written: {[p.name for p in files]}; "
            f"failed checks: {failed[:20]}\n" + res.stdout[-4000:]
        )
    checks = _checks(matrix_root, "restore", world, res.stdout)
    cases = {c["name"] for c in checks}
    # every saved checkpoint was restored here, including the negative control
    assert any("plain-w2 ->" in c for c in cases) and any("fsdp2_tp-w4 ->" in c for c in cases), sorted(cases)
    # ZeRO-style flat fragments saved at 2, 3 and 4 ranks restore into fragments here
    assert {f"fragments-w{w} -> fragments-w{world}" for w in (2, 3, 4)} <= cases, sorted(cases)
    assert_checks(checks, where=f"restore at world size {world}")
    # both read paths ran: straight into the target (large overlaps) and through scratch buffers
    assert any(c.get("bytes_direct", 0) > 0 for c in checks), "no restore used the direct-read path"
