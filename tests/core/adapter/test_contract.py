"""The adapter contract the core owns (shardkeeper.core.adapter, shardkeeper.core.format.progress):
one progress schema read back from every layout, one step rule, shared metadata, restorable
patches and one version gate. The adapters' own tests run it with the real frameworks; the
cross-framework chain (tests/chain) runs it end to end."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.adapter import (
    PROGRESS_SCHEMA,
    Patches,
    Progress,
    ProgressTarget,
    RootManagers,
    VersionGate,
    check_save_step,
    framework_of,
    in_range,
    parse_version,
    progress_state,
    read_progress,
)
from shardkeeper.core.errors import CommitConflictError, StepOrderError


def _save(root: Path, step: int, state: dict, **meta: object) -> None:
    with CheckpointManager(str(root), metadata=meta) as mgr:
        mgr.save(step, {"w": torch.ones(2), **state}, async_save=False)


def _progress(root: Path, step: int) -> Progress:
    with CheckpointManager(str(root)) as mgr:
        return read_progress(mgr.manifest(step))


def test_schema_round_trip_with_every_framework_counters(tmp_path: Path) -> None:
    entry = progress_state(
        step=12,
        epoch=2,
        samples=96,
        counters={
            "deepspeed": {"global_step": 12, "loss_scaler": {"cur_scale": 256.0}},
            "lightning": {"loops": {"a": 1}},
        },
    )
    _save(tmp_path, 12, {"progress": entry})
    p = _progress(tmp_path, 12)
    assert (p.step, p.epoch, p.samples, p.schema, p.checkpoint_step) == (12, 2, 96, PROGRESS_SCHEMA, 12)
    assert p.of("deepspeed") == {"global_step": 12, "loss_scaler": {"cur_scale": 256.0}}
    assert p.of("lightning") == {"loops": {"a": 1}} and p.of("accelerate") == {}


def test_a_checkpoint_without_progress_resumes_at_its_step_number(tmp_path: Path) -> None:
    _save(tmp_path, 5, {})
    p = _progress(tmp_path, 5)
    with CheckpointManager(str(tmp_path)) as mgr:  # a plain core save names its writer too
        meta = mgr.manifest(5).metadata
    assert meta["framework"] == "torch" and meta["shardkeeper_version"] and meta["torch_version"]
    assert (p.step, p.epoch, p.samples, p.schema, dict(p.counters)) == (5, 0, None, None, {})


@pytest.mark.parametrize(
    ("meta", "progress", "want_step", "framework", "counters"),
    [
        # DeepSpeed's counters at the top of progress/ (also saved through plain core managers)
        (
            {},
            {"global_step": 7, "global_samples": 56, "skipped_steps": 0, "micro_steps": 7},
            7,
            "deepspeed",
            {"global_step": 7, "global_samples": 56, "skipped_steps": 0, "micro_steps": 7},
        ),
        # Lightning's, labelled by the older metadata key
        (
            {"framework_adapter": "lightning"},
            {"global_step": 4, "epoch": 1, "loops": {"x": 1}},
            4,
            "lightning",
            {"global_step": 4, "epoch": 1, "loops": {"x": 1}},
        ),
        # Accelerate's under progress/accelerate/, and its oldest layout at the top
        (
            {"framework": "accelerate"},
            {"accelerate": {"iteration": 3, "step": 9}},
            2,
            "accelerate",
            {"iteration": 3, "step": 9},
        ),
        ({}, {"iteration": 5, "step": 17}, 2, "accelerate", {"iteration": 5, "step": 17}),
    ],
)
def test_older_layouts_are_read(
    tmp_path: Path, meta: dict, progress: dict, want_step: int, framework: str, counters: dict
) -> None:
    step = progress.get("global_step", 2)
    _save(tmp_path, step, {"progress": progress}, **meta)
    p = _progress(tmp_path, step)
    assert p.schema is None and p.step == want_step and p.of(framework) == counters


def test_lightning_on_deepspeed_older_layout(tmp_path: Path) -> None:
    _save(
        tmp_path,
        6,
        {
            "progress": {"global_step": 6, "global_samples": 48, "skipped_steps": 1, "micro_steps": 6},
            "extra": {"lightning": {"progress": {"global_step": 6, "epoch": 2}}},
        },
    )
    p = _progress(tmp_path, 6)
    assert (p.step, p.epoch, p.samples) == (6, 2, 48)
    assert p.of("lightning") == {"global_step": 6, "epoch": 2} and p.of("deepspeed")["skipped_steps"] == 1


def test_progress_state_refuses_bad_counts_and_shared_names() -> None:
    for bad in ({"step": -1}, {"step": True}, {"step": 1, "epoch": 1.5}, {"step": 1, "samples": -3}):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            progress_state(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared progress key"):
        progress_state(step=1, counters={"epoch": {}})


class _Counter(ProgressTarget):
    def __init__(self) -> None:
        self.step, self.seen = 3, None

    def state_dict(self) -> dict:
        return progress_state(step=self.step, counters={"mine": {"n": self.step * 10}})

    def load_progress(self, progress: Progress) -> None:
        self.seen = progress


def test_a_progress_target_is_handed_the_restored_steps_progress(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, {"w": torch.ones(2), "progress": _Counter()}, async_save=False)
        mgr.save(4, {"w": torch.ones(2)}, async_save=False)  # another framework's: no progress
        target = _Counter()
        assert mgr.restore({"w": torch.zeros(2), "progress": target}, step=3) == 3
        assert target.seen is not None and target.seen.of("mine") == {"n": 30} and target.seen.step == 3
        target = _Counter()
        mgr.restore({"w": torch.zeros(2), "progress": target})  # newest: step 4, no progress saved
        assert target.seen is not None and (target.seen.step, target.seen.of("mine")) == (4, {})
        target = _Counter()
        mgr.restore({"w": torch.zeros(2), "progress": target}, only=["w"])  # not selected: untouched
        assert target.seen is None
        mgr.save(6, {"w": torch.ones(2), "note": "six", "progress": _Counter()}, async_save=False)
        state = {"w": torch.zeros(2), "note": None, "progress": _Counter()}
        mgr.restore(state, step=6)  # top-level JSON values still land in the caller's dict
        assert state["note"] == "six" and torch.equal(state["w"], torch.ones(2))


def test_save_step_rule(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        assert not check_save_step(mgr, 0).refused
        mgr.save(5, {"w": torch.ones(1)}, async_save=False)
        mgr.save(9, {"w": torch.ones(1)})  # in flight: check_save_step waits for it
        ok = check_save_step(mgr, 10)
        assert not ok.refused and ok.newest == 9 and ok.error("x") is None
        same = check_save_step(mgr, 9)
        assert same.committed
        with pytest.raises(CommitConflictError, match=r"^Fw: step 9 is already committed under .* \(rank 0\);.*Fix it"):
            same.raise_if_refused("Fw", "Fix it.")
        lower = check_save_step(mgr, 7)
        assert lower.refused and not lower.committed
        with pytest.raises(
            StepOrderError,
            match=r"step 7 is below the newest committed step 9 under .* \(rank 0\): a "
            r"resume from this root would go back to step 9",
        ) as e:
            lower.raise_if_refused("Fw")
        assert (e.value.step, e.value.newest) == (7, 9) and isinstance(e.value, CommitConflictError)
        assert check_save_step(mgr, 5).committed  # an older committed step is named as committed
        with pytest.raises(ValueError, match="non-negative int"):
            check_save_step(mgr, -1)


def test_root_managers_write_the_shared_metadata(tmp_path: Path) -> None:
    managers = RootManagers("fw", "1.2.3", {"metadata": {"run": "a"}, "keep_last": 2}, extra_key="x")
    mgr = managers.get(tmp_path / "r")
    assert managers.get(str(tmp_path / "r")) is mgr and len(managers) == 1 and mgr.retention.keep_last == 2
    mgr.save(1, {"w": torch.ones(1)}, async_save=False)
    meta = mgr.manifest(1).metadata
    assert {
        k: meta[k] for k in ("framework", "framework_version", "fw_version", "progress_schema", "run", "extra_key")
    } == {
        "framework": "fw",
        "framework_version": "1.2.3",
        "fw_version": "1.2.3",
        "progress_schema": PROGRESS_SCHEMA,
        "run": "a",
        "extra_key": "x",
    }
    assert meta["torch_version"] == str(torch.__version__) and "shardkeeper_version" in meta
    assert framework_of(mgr.manifest(1)) == "fw"
    managers.close()
    assert len(managers) == 0
    with pytest.raises(ValueError, match=r"metadata key\(s\) framework are written by the fw adapter itself"):
        RootManagers("fw", "1", {"metadata": {"framework": "mine"}})
    with pytest.raises(ValueError, match=r"metadata key\(s\) extra_key, fw_version are written by the fw adapter"):
        RootManagers("fw", "1", {"metadata": {"fw_version": "0", "extra_key": 1}}, extra_key="x")


def test_patches_restore_exactly_what_was_there() -> None:
    class A:
        def m(self) -> str:
            return "class"

        p = property(lambda self: "prop")

    a = A()
    a.own = "instance"  # type: ignore[attr-defined]
    patches = Patches()
    patches.set(a, "m", lambda: "patched")
    patches.set(a, "own", "patched")
    patches.set(a, "new", 1)
    patches.set(A, "p", property(lambda self: "patched prop"))
    assert (a.m(), a.own, a.new, a.p) == ("patched", "patched", 1, "patched prop")  # type: ignore[attr-defined]
    assert patches.patched(a, "m") and not patches.patched(a, "other")
    patches.restore()
    assert (a.m(), a.own, a.p) == ("class", "instance", "prop") and not hasattr(a, "new")  # type: ignore[attr-defined]
    assert "m" not in vars(a)  # the class's method shows through again, not a copy of it
    patches.restore()  # idempotent


def test_version_gate_warns_once_outside_the_range() -> None:
    inside = VersionGate("pkg", "Torch", "torch", ((2, 13), (2, 14)), "why")  # the installed torch 2.13
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside.warn_if_untested()
    assert inside.in_range() and inside.range_text() == "2.13 to <2.14"
    outside = VersionGate("pkg", "Torch", "torch", ((2, 5), (2, 7)), "its internals decide")
    with pytest.warns(
        UserWarning,
        match=r"^pkg was verified with Torch 2.5 to <2.7; 2.13\S* is outside that range "
        r"\(its internals decide\)$",
    ):
        outside.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outside.warn_if_untested()  # once per gate
    assert (
        not outside.in_range() and in_range("2.6.0rc1", ((2, 5), (2, 7))) and parse_version("5.24.0.dev0") == (5, 24, 0)
    )


@pytest.mark.parametrize(
    "progress",
    [
        {"schema": 1, "step": -5},
        {"schema": 1, "step": "7"},
        {"schema": 1, "step": 2.5},
        {"schema": 1, "step": True},
        {"schema": 1, "step": 10**30},
        {"schema": 2, "step": 9},
        {"schema": "1", "step": 9},
        {"schema": 1, "step": 9, "epoch": -1},
        {"schema": 1, "step": 9, "samples": 2**64},
    ],
)
def test_an_untrustworthy_progress_entry_warns_and_resumes_at_the_step_number(tmp_path: Path, progress: dict) -> None:
    _save(tmp_path, 3, {"progress": {**progress, "accelerate": {"iteration": 10**30}}})
    with pytest.warns(
        UserWarning,
        match=r"the checkpoint of step 3: progress/.* its step count resumes from the "
        r"checkpoint's step number 3",
    ):
        p = _progress(tmp_path, 3)
    assert (p.step, p.epoch, p.samples, p.schema, dict(p.counters)) == (3, 0, None, None, {})


def test_a_framework_counter_that_is_not_a_count_falls_back_with_a_warning(tmp_path: Path) -> None:
    _save(tmp_path, 4, {"progress": progress_state(step=4, counters={"fw": {"n": 10**30, "m": 7, "s": "x"}})})
    p = _progress(tmp_path, 4)
    assert p.count("fw", "m", 0) == 7 and p.count("fw", "absent", 1) == 1
    with pytest.warns(
        UserWarning,
        match=r"step 4: progress/fw/n is 1000000000000000000000000000000, not a count; "
        r"5 is used instead",
    ):
        assert p.count("fw", "n", 5) == 5
    with pytest.warns(UserWarning, match=r"progress/fw/s is 'x', not a count"):
        assert p.count("fw", "s", 0) == 0
