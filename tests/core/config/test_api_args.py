"""The manager's API explains itself: visible, typed options; argument mistakes named as such;
no silent empty restore; a warning only for a save nobody waited for, shown by default.
"""

from __future__ import annotations

import gc
import inspect
import pydoc
import subprocess
import sys
import textwrap
import time
import typing
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager, CheckpointOptions, SaveHandle, StateMismatchError
from shardkeeper.core.config.options import OPTION_NAMES, option_types
from shardkeeper.core.format.progress import ProgressTarget, progress_state

#: The manager's own keywords; every other one is a CheckpointOptions field.
OWN = (
    "keep_last",
    "keep_every",
    "process_group",
    "storage_options",
    "metadata",
    "options",
    "local",
    "persist_every",
    "replicas",
    "erasure",
    "local_keep",
)


class _LargeModel:
    """An object whose repr would be huge: errors name its type only."""

    def __repr__(self) -> str:
        return "Linear(" * 1000


# -- the options in the signature ------------------------------------------------------------


def test_the_signature_lists_every_option_with_its_type_and_default() -> None:
    params = inspect.signature(CheckpointManager.__init__).parameters
    keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords[: len(OWN)] == list(OWN)
    assert tuple(keywords[len(OWN) :]) == OPTION_NAMES  # adding an option without exposing it fails
    hints = typing.get_type_hints(CheckpointManager.__init__)
    defaults = CheckpointOptions()
    for name, hint in option_types().items():
        assert hints[name] == hint, name
        assert repr(params[name].default) == repr(getattr(defaults, name)), name
    text = pydoc.render_doc(CheckpointManager, renderer=pydoc.plaintext)
    for shown in ("async_save: 'bool' = True", "staging: 'Staging' = 'blocking'", "retry_max_attempts: 'int' = 5"):
        assert shown in text
    for group in ("saving:", "codecs:", "retry:", "catalog:"):
        assert group in (CheckpointManager.__init__.__doc__ or "")


def test_a_keyword_overrides_options_only_where_given(tmp_path: Path) -> None:
    base = CheckpointOptions(async_save=False, io_threads=2, compression="zstd")
    with CheckpointManager(tmp_path, options=base, io_threads=3) as mgr:
        o = mgr.options
        assert (o.async_save, o.io_threads, o.compression) == (False, 3, "zstd")
    with CheckpointManager(tmp_path, options=base, compression=None) as mgr:  # None given: stands
        assert mgr.options.compression is None and mgr.options.async_save is False
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.options == CheckpointOptions()


def test_unknown_and_mistyped_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"asynch_save \(did you mean async_save\?\)"):
        CheckpointManager(tmp_path, asynch_save=False)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="io_threads='4' is of type str"):
        CheckpointManager(tmp_path, io_threads="4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging='fast'; choose one of blocking, overlap"):
        CheckpointManager(tmp_path, staging="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (
            {"metadata": [1]},
            TypeError,
            r"^CheckpointManager\(\): metadata must be a mapping \(dict\) or None, got list$",
        ),
        ({"storage_options": "x"}, TypeError, r"storage_options must be a mapping \(dict\) or None, got str 'x'$"),
        (
            {"options": {"async_save": False}},
            TypeError,
            r"options must be a CheckpointOptions or None, got dict \(pass",
        ),
        ({"options": _LargeModel()}, TypeError, r"options must be a CheckpointOptions or None, got _LargeModel$"),
        ({"keep_last": "3"}, TypeError, r"keep_last must be an int >= 1 or None, got str '3'$"),
        ({"keep_every": 2.0}, TypeError, r"keep_every must be an int >= 1 or None, got float 2\.0$"),
        ({"keep_last": True}, TypeError, r"keep_last must be an int >= 1 or None, got bool True$"),
        ({"keep_last": 0}, ValueError, r"keep_last must be >= 1 or None \(no limit\), got 0$"),
        ({"keep_every": np.int64(-1)}, ValueError, r"keep_every must be >= 1 or None \(no limit\), got -1$"),
        (
            {"process_group": 3},
            TypeError,
            r"process_group must be a torch\.distributed ProcessGroup, None or 'local', got int 3",
        ),
        ({"process_group": _LargeModel()}, TypeError, r"process_group must be .*, got _LargeModel$"),
    ],
)
def test_the_managers_own_keywords_are_type_checked(tmp_path: Path, kwargs: Any, error: type, text: str) -> None:
    with pytest.raises(error, match=text) as e:
        CheckpointManager(tmp_path / "r", **kwargs)
    assert "Linear(" not in str(e.value)  # the type's name, never the object's repr
    assert not (tmp_path / "r").exists()  # refused before the root is touched


def test_a_root_of_the_wrong_type_is_named() -> None:
    with pytest.raises(
        TypeError, match=r"root must be a path \(str or os\.PathLike\), an fsspec URL or a Storage, got int 3"
    ):
        CheckpointManager(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("wrong", "right"),
    [
        ("keep_lst", "keep_last"),
        ("keepevery", "keep_every"),
        ("proces_group", "process_group"),
        ("storage_option", "storage_options"),
        ("asynch_save", "async_save"),
    ],
)
def test_a_misspelt_keyword_gets_the_close_match_among_all_keywords(tmp_path: Path, wrong: str, right: str) -> None:
    with pytest.raises(TypeError) as e:
        CheckpointManager(tmp_path / "r", **{wrong: 3})
    msg = str(e.value)
    assert msg.startswith(f"unknown CheckpointManager keyword(s): {wrong} (did you mean {right}"), msg
    assert "; the manager's own: " + ", ".join(OWN) + "; the options, by group: saving: async_save" in msg, msg
    assert not (tmp_path / "r").exists()


def test_steps_of_any_integral_type_are_taken_as_ints(tmp_path: Path) -> None:
    w = torch.arange(4.0)
    with CheckpointManager(tmp_path, async_save=False, keep_last=np.int64(2)) as mgr:
        assert mgr.retention.keep_last == 2 and type(mgr.retention.keep_last) is int
        for step in np.arange(3):  # numpy.int64 steps
            mgr.save(step, {"w": w * int(step)})
        assert mgr.steps() == [1, 2]
        assert mgr.is_committed(np.int64(2)) and mgr.manifest(np.int32(2)).step == 2
        assert mgr.step_url(np.uint8(2)) == mgr.step_url(2)
        target = {"w": torch.zeros(4)}
        assert mgr.restore(target, step=np.int64(1)) == 1 and torch.equal(target["w"], w)
        assert torch.equal(mgr.load(np.int16(2))["w"], w * 2)
        assert mgr.delete(np.int64(1)) and mgr.steps() == [2]
        with pytest.raises(ValueError, match=r"save\(\): step must be >= 0, got -3"):
            mgr.save(np.int64(-3), {"w": w})
        with pytest.raises(TypeError, match=r"save\(\): step must be an int >= 0, got bool;"):
            mgr.save(np.bool_(True), {"w": w})
        with pytest.raises(TypeError, match=r"save\(\): step must be an int >= 0, got float64"):
            mgr.save(np.float64(3.0), {"w": w})


def test_wait_close_and_the_handle_say_what_they_block_on_and_raise() -> None:
    for fn in (CheckpointManager.wait, CheckpointManager.close, SaveHandle.wait):
        doc = inspect.getdoc(fn) or ""
        assert "Block" in doc or "Wait" in doc, fn
        assert "Raise" in doc and "Ctrl-C" in doc, fn
    assert "wait()" in (inspect.getdoc(SaveHandle) or "")


# -- argument mistakes ---------------------------------------------------------------------------


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])


def test_swapped_step_and_state_are_named(tmp_path: Path) -> None:
    model = _model()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": model})
        with pytest.raises(TypeError) as e:
            mgr.save({"model": model}, 3)  # type: ignore[arg-type]
        assert "save(): step must be an int, got a dict (the state?)" in str(e.value)
        assert "mgr.save(step, state)" in str(e.value) and "Linear(" not in str(e.value)
        with pytest.raises(TypeError) as e:
            mgr.save(3, model)  # type: ignore[arg-type]
        assert "state must be a mapping" in str(e.value) and "got Sequential" in str(e.value)
        assert "Linear(" not in str(e.value)
        with pytest.raises(TypeError, match=r"restore\(\): state must be a mapping .* got int 2 \(the step\? "):
            mgr.restore(2, {"model": model})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"call it as mgr\.restore\(state, step=None\)"):
            mgr.restore(2, {"model": model})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"restore\(\): step must be an int >= 0 or None, got str"):
            mgr.restore({"model": model}, "latest")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda m: m.save(True, {}), TypeError, r"save\(\): step must be an int >= 0, got bool True"),
        (lambda m: m.save(-1, {}), ValueError, r"save\(\): step must be >= 0, got -1"),
        (lambda m: m.save(1.0, {}), TypeError, r"got float 1\.0; call it as mgr\.save\(step, state\)"),
        (lambda m: m.delete("3"), TypeError, r"delete\(\): step must be an int >= 0, got str"),
        (lambda m: m.delete(-2), ValueError, r"delete\(\): step must be >= 0"),
        (lambda m: m.manifest(1.5), TypeError, r"manifest\(\): step must be an int >= 0 or None, got float"),
        (lambda m: m.is_committed(None), TypeError, r"is_committed\(\): step must be an int >= 0, got NoneType"),
        (lambda m: m.is_committed({}), TypeError, r"is_committed\(\): step must be an int, got a dict"),
        (lambda m: m.step_url(-1), ValueError, r"step_url\(\): step must be >= 0"),
        (lambda m: m.load(True), TypeError, r"load\(\): step must be an int >= 0 or None, got bool"),
        (lambda m: m.restore({"w": torch.ones(1)}, -4), ValueError, r"restore\(\): step must be >= 0"),
    ],
)
def test_a_bad_step_or_state_names_the_argument(tmp_path: Path, call: Any, error: type, text: str) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(error, match=text):
            call(mgr)


# -- no silent empty restore ---------------------------------------------------------------------


class _Progress(ProgressTarget):
    def __init__(self) -> None:
        self.seen: Any = None

    def state_dict(self) -> dict[str, Any]:
        return progress_state(step=7)

    def load_progress(self, progress: Any) -> None:
        self.seen = progress


def test_restore_of_an_empty_target_is_an_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(7, {"w": torch.ones(2), "progress": _Progress()})
        for empty in ({}, {"model": {}}, {"a": {}, "b": {"c": {}}}):
            with pytest.raises(ValueError) as e:
                mgr.restore(empty)
            text = str(e.value)
            assert f"step 7 under {tmp_path}" in text and "mgr.load()" in text and "pass the state" in text
        with pytest.raises(StateMismatchError, match=r"only=\['nope/\*'\] matches no key"):
            mgr.restore({"w": torch.zeros(2)}, only="nope/*")
        target = _Progress()  # progress targets alone read the manifest: still fine
        assert mgr.restore({"progress": target}) == 7 and target.seen.step == 7


# -- the warning for a save nobody waited for ----------------------------------------------------


def _collect(ref: weakref.ref[Any], timeout_s: float = 30.0) -> None:
    """Until the manager is gone (its background thread may hold it a moment longer)."""
    deadline = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert ref() is None, "the manager was never collected"


def test_no_warning_when_every_save_was_waited_for(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for how in ("handle", "manager", "sync"):
            mgr = CheckpointManager(tmp_path / how)
            if how == "handle":
                mgr.save(1, {"x": torch.ones(4)}).wait()
            elif how == "manager":
                mgr.save(1, {"x": torch.ones(4)})
                mgr.wait()
            else:
                mgr.save(1, {"x": torch.ones(4)}, async_save=False)
            ref = weakref.ref(mgr)
            del mgr  # never closed: nothing was left unchecked, so nothing to warn about
            _collect(ref)
    assert [str(w.message) for w in caught] == []


def test_a_save_never_waited_for_warns_visibly_by_default(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import gc, sys, time, weakref
        import torch
        from shardkeeper.core import CheckpointManager

        mgr = CheckpointManager(sys.argv[1])
        mgr.save(1, {"x": torch.ones(4)})
        ref = weakref.ref(mgr)
        del mgr
        deadline = time.monotonic() + 30
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.02)
        print("collected", ref() is None)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, env=None
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "collected True" in res.stdout
    assert "UnwaitedSaveWarning" in res.stderr, res.stderr[-3000:]
    assert "step 1 never waited for" in res.stderr and str(tmp_path) in res.stderr
    assert "mgr.wait()" in res.stderr and "mgr.close()" in res.stderr


def test_a_one_shot_save_that_was_waited_for_never_warns(tmp_path: Path) -> None:
    """``CheckpointManager(root).save(step, state).wait()``: the manager is collected (in the
    save's thread) while its handle still waits; before, 18 of 30 such saves warned that they
    were never waited for. The warning now comes from the handle, which the wait still holds."""
    script = textwrap.dedent(
        """
        import gc, sys
        import torch
        from shardkeeper.core import CheckpointManager

        for step in range(30):
            CheckpointManager(sys.argv[1]).save(step, {"x": torch.ones(4) * step}).wait()
        gc.collect()
        print("saved", len([p for p in __import__("os").listdir(sys.argv[1]) if p.startswith("step-")]))
        """
    )
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "saved 30" in res.stdout, res.stdout
    assert "UnwaitedSaveWarning" not in res.stderr, res.stderr[-3000:]
