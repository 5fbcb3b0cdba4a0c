"""The private Lightning names the adapter uses: present on the installed release, used only in
``_internals.py``, and a clear error or warning when a release differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest

from shardkeeper.lightning import _internals as li
from tests.lightning.common import Net, loader
from tests.private_access import gate_warnings, internals_accesses, own_trust_checks, private_accesses

PACKAGE = Path(li.__file__).parent


def test_every_internal_is_present_on_the_installed_lightning() -> None:
    """A release that renames or removes one fails here (then update ``_internals``, and bump
    ``TESTED_RANGE`` once this suite passes on it)."""
    import lightning

    present = li.contract_check()
    assert present and all(present.values()), {k: v for k, v in present.items() if not v}
    assert li.version_tested(), f"Lightning {lightning.__version__} is outside TESTED_RANGE {li.TESTED_RANGE}"


def test_trainer_of_is_the_trainer_running_the_module(tmp_path: Path) -> None:
    seen: list[Any] = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            seen.append(li.trainer_of(pl_module) is trainer and trainer.state.status.value == "running")

    net = Net()
    assert li.trainer_of(net) is None  # not attached: None, where the public lm.trainer raises
    with pytest.raises(RuntimeError, match="not attached"):
        _ = net.trainer
    t = L.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Probe()],
    )
    t.fit(net, loader())
    assert seen == [True, True]
    assert li.trainer_of(net) is t


def test_parse_optimizers_reads_configure_optimizers_as_the_trainer_does(tmp_path: Path) -> None:
    net = Net()
    t = L.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    t.fit(net, loader())
    conf = net.configure_optimizers()  # {"optimizer": ..., "lr_scheduler": {...}}
    assert li.parse_optimizers(conf) == [conf["optimizer"]]
    assert [type(o) for o in li.parse_optimizers(conf)] == [type(o) for o in t.optimizers]


def test_a_missing_internal_fails_naming_it() -> None:
    with pytest.raises(li.LightningInternalsError, match=r"lacks LightningModule\._trainer.*verified with Lightning"):
        li.trainer_of(object())


def test_a_release_outside_the_tested_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning

    inside, outside = gate_warnings(li, monkeypatch)
    assert inside == []
    assert outside == [
        f"shardkeeper.lightning was verified with Lightning 0.1 to <0.2; {lightning.__version__} is outside that range "
        "(its internals are checked where they are used)"
    ]


def test_private_attributes_are_used_only_in_the_internals_module() -> None:
    assert private_accesses(PACKAGE, "_internals.py") == []
    seen = " ".join(internals_accesses(PACKAGE, "_internals.py"))
    assert "lm._trainer" in seen and "_configure_optimizers" in seen


def test_trust_pickle_is_only_passed_to_the_core_gate() -> None:
    """The core's ``require_trust`` is the one ``trust_pickle`` gate (PermissionError); the
    adapter never tests the value itself."""
    from shardkeeper.core.state import unpickle as legacy

    assert own_trust_checks(PACKAGE) == []
    assert own_trust_checks(Path(legacy.__file__).parent)  # the scan sees the gate's own test
