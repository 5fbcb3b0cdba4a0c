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

import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager, CheckpointOptions, SaveHandle, StateMismatchError
from shardkeeper.core.options import OPTION_NAMES, option_types
from shardkeeper.core.progress import ProgressTarget, progress_state

#: The manager's own keywords; every other one is a CheckpointOptions field.
OWN = ("keep_last", "keep_every", "process_group", "storage_options", "metadata", "options")

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
