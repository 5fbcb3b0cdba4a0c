"""Real DeepSpeed ZeRO-1/2/3 engines (fp32 and bf16) on gloo/CPU, saved at world size 2 and
restored at world sizes 1, 2 and 3, across stages, and to and from plain torch and FSDP2.

Every restored engine's fp32 master weights and Adam moments must equal DeepSpeed's own
``safe_get_full_*`` of the saved engine bit for bit; at the saver's world size and stage the
next losses must equal the uninterrupted run's bit for bit; at another world size, DeepSpeed's
own universal-checkpoint resume. One launch covers many cases (``dist/worker.py``).

A ZeRO stage that DeepSpeed itself cannot train with the installed torch (a plain DeepSpeed
step fails, before any shardkeeper code runs) is left out of the matrix with a warning; on
DeepSpeed >= 0.19 every stage must train.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script
from tests.persist_probe import assert_persist_processes_gone, persist_check

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "worker.py"
DTYPES = ("fp32", "bf16", "fp16")


def _checks(root: Path, phase: str, world: int, output: str = "") -> list[dict]:
    return read_checks(*sorted((root / "results").glob(f"{phase}-w{world}-r*.json")), output=output)


def _stages(root: Path) -> list[int]:
    return json.loads((root / "stages.json").read_text())["working"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ds")
    res = run_script(2, WORKER, "save", str(root), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    # native DeepSpeed checkpoints of two cases, imported here (one process)
    from shardkeeper.deepspeed.native import import_native_checkpoint

    for name in ("z2-fp32", "z3-bf16"):
        if int(name[1]) not in _stages(root):
            continue
        with pytest.warns(UserWarning, match="unpickling"):
            step = import_native_checkpoint(
                root / "native" / name,
                str(root / "ckpt" / f"imported-{name}"),
                trust_pickle=True,
                universal_dir=root / "universal" / name,
            )
        assert step == 3
    return root


def test_stages_deepspeed_cannot_train_are_its_own_failure(saved: Path) -> None:
    import deepspeed

    info = json.loads((saved / "stages.json").read_text())
    assert 3 in info["working"], info["broken"]
    for stage, tb in info["broken"].items():
        assert "deepspeed/runtime" in tb and "shardkeeper" not in tb, tb
        warnings.warn(
            f"DeepSpeed {deepspeed.__version__} cannot train ZeRO-{stage} with this torch "
            f"(left out of the matrix): {tb.strip().splitlines()[-1]}",
            stacklevel=1,
        )
    if not info["fp16_probe"]:
        warnings.warn(
            "DeepSpeed's CPU accelerator finds no oneDNN fp16 kernels on this CPU; the fp16 "
            "engines ran on torch's generic half kernels",
            stacklevel=1,
        )
    if tuple(int(x) for x in deepspeed.__version__.split(".")[:2]) >= (0, 19):
        assert info["working"] == [1, 2, 3], info["broken"]


def test_every_case_saves_and_internals_hold(saved: Path) -> None:
    checks = _checks(saved, "save", 2)
    cases = {c["name"] for c in checks}
    for s in (1, 2, 3):
        assert f"internals z{s}: present (a new DeepSpeed release changed them if not)" in cases
    for s in _stages(saved):
        for d in DTYPES:
            assert f"z{s}-{d}: committed" in cases, sorted(cases)
    # the hook cases wrote nothing of DeepSpeed's own format
    assert any("hook wrote no DeepSpeed files" in c for c in cases)
    assert any("hook settings from the DeepSpeed config" in c for c in cases)
    assert_checks(checks)


def test_native_import_refuses_pickles_without_opt_in(saved: Path, tmp_path: Path) -> None:
    from shardkeeper.deepspeed.native import import_native_checkpoint

    with pytest.raises(PermissionError, match="trust_pickle=True"):
        import_native_checkpoint(saved / "native" / "z3-bf16", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_restore_at_any_world_size_and_stage(saved: Path, world: int) -> None:
    res = run_script(world, WORKER, "restore", str(saved), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    stages = _stages(saved)
    checks = _checks(saved, "restore", world, res.stdout)
    cases = {c["name"] for c in checks}
    for s in stages:
        for d in DTYPES:
            src = f"z{s}-{d}-w2"
            for t in stages:
                want = f"{src} -> z{t}-{d}-w{world}: fp32 masters and Adam moments bit-exact vs safe_get_full_*"
                assert want in cases, (want, sorted(cases))
            if world == 2:
                assert f"{src} -> z{s}-{d}-w2: next losses bit-exact vs uninterrupted" in cases
    # cross-framework, both directions, imports, and the bad-input errors
    assert f"plain-w2 -> z3-fp32-w{world}: params and moments bit-exact" in cases
    assert f"z3-bf16-w2 -> plain-w{world}: params and moments bit-exact" in cases
    assert f"z3-bf16-w2 -> fsdp2-w{world}: params and moments bit-exact" in cases
    assert any(
        c.startswith("fsdp2-w2 -> z") and c.endswith(f"-fp32-w{world}: params and moments bit-exact") for c in cases
    )
    assert f"mismatch-w{world}: clear error listing every mismatch" in cases
    for name, t in (("z2-fp32", 1), ("z2-fp32", 3), ("z3-bf16", 1), ("z3-bf16", 3)):
        if int(name[1]) in stages and t in stages:
            d = name.split("-")[1]
            assert f"imported-{name}-w2 -> z{t}-{d}-w{world}: fp32 masters and Adam moments bit-exact" in cases
    for opt in (
        "load_module_only restores weights only",
        "load_optimizer_states=False keeps the optimizer",
        "nothing committed -> (None, None) and a warning",
        "a named tag saves at global_steps and loads by name",
        "saving a committed step again is refused",
    ):
        assert f"hook-options-w{world}: {opt}" in cases
    if world != 2 and 2 in stages:
        assert f"z2-fp32-w2 -> z2-fp32-w{world} vs DeepSpeed universal: next losses equal" in cases
    assert_checks(checks)


def test_hook_saves_resume_bit_for_bit_with_the_process_writer(tmp_path: Path) -> None:
    """The hook's cases again, with ``writer="process"`` from the DeepSpeed config's section (and
    ``attach``'s arguments): saved at world size 2 through persist processes, restored in new
    processes at the same stage bit for bit (masters, moments, next losses), the hook's options
    hold, and no persist process outlives its trainer."""
    env = {"SK_CASES": "hook", "SK_WRITER": "process", "SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    for phase in ("save", "restore"):
        res = run_script(2, WORKER, phase, str(tmp_path), timeout_s=240, env=env)
        assert res.returncode == 0, res.stdout[-4000:]
    stages = _stages(tmp_path)
    hooked = [f"z{s}-{d}" for s, d in ((2, "bf16"), (3, "fp32")) if s in stages]  # the worker's HOOK_CASES
    assert hooked, stages
    want = [
        f"hook-options-w2: {opt}"
        for opt in ("a named tag saves at global_steps and loads by name", "saving a committed step again is refused")
    ]
    want.append(persist_check("hook-options-w2"))
    for name in hooked:
        want += [f"{name}: committed", persist_check(name)]
        want.append(f"{name}-w2 -> {name}-w2: next losses bit-exact vs uninterrupted")
        want.append(f"{name}-w2 -> {name}-w2: fp32 masters and Adam moments bit-exact vs safe_get_full_*")
    assert_checks(_checks(tmp_path, "save", 2) + _checks(tmp_path, "restore", 2), want)
    assert_persist_processes_gone(*(tmp_path / f"persist-pids-r{r}" for r in range(2)))
