"""The private Trainer methods the adapter replaces or calls: present with the parameters it
expects on the installed release, used only in ``_internals.py``, and a clear error or
warning when a release differs."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("shardkeeper.transformers")

import transformers  # noqa: E402
from transformers import Trainer  # noqa: E402

from shardkeeper.transformers import _internals as tfi  # noqa: E402
from tests.private_access import gate_warnings, internals_accesses, private_accesses  # noqa: E402
from tests.transformers.common import make_trainer  # noqa: E402

PACKAGE = Path(tfi.__file__).parent


def test_every_internal_is_present_on_the_installed_transformers() -> None:
    """A release that renames, removes or reshapes one fails here (then update ``_internals``,
    and bump ``TESTED_RANGE`` once this suite passes on it)."""
    present = tfi.contract_check()
    assert present and all(present.values()), {k: v for k, v in present.items() if not v}
    assert tfi.GATE.in_range(), f"transformers {transformers.__version__} is outside TESTED_RANGE {tfi.TESTED_RANGE}"
    assert set(tfi.METHODS) >= {"_save_checkpoint", "_load_rng_state", "_inner_training_loop", "_init_training_state"}


def test_enable_replaces_exactly_the_listed_methods(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path / "run")
    replaced = {n for n in vars(trainer) if callable(vars(trainer)[n]) and hasattr(Trainer, n)}
    expected = set(tfi.METHODS) - {"_load_callback_state", "store_flos"}  # called, not replaced
    assert replaced == expected
    for name in replaced:  # each replacement takes what the Trainer passes to its own method
        own = [p for p in inspect.signature(getattr(Trainer, name)).parameters if p != "self"]
        ours = list(inspect.signature(vars(trainer)[name]).parameters)
        assert ours[: len(own)] == own[: len(ours)] and len(ours) >= len(tfi.METHODS[name]), (name, own, ours)


def test_a_changed_signature_fails_at_enable_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a release that renamed a parameter of one of the methods: refused when the Trainer is
    built, naming the method, before anything is replaced."""

    def changed(self: Any, checkpoint_path: Any) -> None:  # the parameter renamed
        pass

    monkeypatch.setattr(Trainer, "_load_rng_state", changed)
    with pytest.raises(
        tfi.TransformersInternalsError, match=r"lacks Trainer internals .*Trainer\._load_rng_state.*verified"
    ):
        make_trainer(tmp_path / "run")


def test_a_release_outside_the_tested_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    inside, outside = gate_warnings(tfi, monkeypatch)
    assert inside == []
    assert outside == [
        f"shardkeeper.transformers was verified with transformers 0.1 to <0.2; {transformers.__version__} is outside "
        "that range (its Trainer internals passed the checks)"
    ]


def test_private_methods_are_used_only_in_the_internals_module() -> None:
    assert private_accesses(PACKAGE, "_internals.py") == []
    seen = " ".join(internals_accesses(PACKAGE, "_internals.py"))
    assert "_inner_training_loop" in seen and "_load_callback_state" in seen
