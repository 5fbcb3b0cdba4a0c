"""The private Accelerate attributes the adapter uses: present on the installed release, used
only in ``_internals.py``, and a clear error or warning when a release differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska
from shardkeeper.accelerate import _internals as acci
from tests.private_access import gate_warnings, internals_accesses, own_trust_checks, private_accesses

PACKAGE = Path(acci.__file__).parent


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def _prepared() -> tuple[Accelerator, tuple[object, ...], _Counter]:
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    dl = DataLoader(TensorDataset(torch.arange(10.0).unsqueeze(1)), batch_size=3)
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    return acc, acc.prepare(lin, opt, sched, dl), counter


def test_every_internal_is_present_on_the_installed_accelerate() -> None:
    """A release that renames or removes one fails here (then update ``_internals``, and bump
    ``TESTED_RANGE`` once this suite passes on it)."""
    import accelerate

    acc, (model, opt, sched, dl), counter = _prepared()
    present = acci.contract_check(acc)
    assert present and all(present.values()), {k: v for k, v in present.items() if not v}
    assert acci.version_tested(), f"Accelerate {accelerate.__version__} is outside TESTED_RANGE {acci.TESTED_RANGE}"
    # ... and each one means what the adapter takes it for.
    assert acci.prepared_models(acc) == [model]
    assert acci.prepared_optimizers(acc) == [opt]
    assert acci.prepared_schedulers(acc) == [sched]
    assert acci.prepared_dataloaders(acc) == [dl]
    assert acci.registered_objects(acc) == [counter]
    acc.end_training()


def test_per_batch_hook_runs_before_each_batch_is_yielded() -> None:
    """Before each batch, and once more before the last (where the look-ahead ends): the
    tracker's resume point relies on exactly this (dataloaders.LoaderTracker)."""
    acc, (_, _, _, dl), _ = _prepared()
    assert type(dl).__name__ == "DataLoaderShard"
    calls: list[int] = []

    def hook() -> None:
        original()
        calls.append(len(calls) + 1)

    original = acci.hook_per_batch(dl, hook)
    seen = [len(calls) for _ in dl]
    assert seen == [1, 2, 3, 5]  # 10 samples, batches of 3
    assert [len(calls) for _ in dl] == [6, 7, 8, 10]  # the hook stays for later epochs
    acc.end_training()


def test_a_missing_internal_fails_at_enable_naming_it(tmp_path: Path) -> None:
    acc, _, _ = _prepared()
    del acc._custom_objects
    missing = r"lacks internals .*Accelerator\._custom_objects.*verified"
    with pytest.raises(acci.AccelerateInternalsError, match=missing):
        ska.enable(acc, root=str(tmp_path / "r"))


def test_a_release_outside_the_tested_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate

    inside, outside = gate_warnings(acci, monkeypatch)
    assert inside == []
    assert outside == [
        f"shardkeeper.accelerate was verified with Accelerate 0.1 to <0.2; {accelerate.__version__} is outside that range "
        "(its internals passed the checks)"
    ]


def test_private_attributes_are_used_only_in_the_internals_module() -> None:
    assert private_accesses(PACKAGE, "_internals.py") == []
    seen = " ".join(internals_accesses(PACKAGE, "_internals.py"))
    assert all(f"accelerator.{n}" in seen for n in acci.ACCELERATOR_LISTS) and "_update_state_dict" in seen


def test_trust_pickle_is_only_passed_to_the_core_gate() -> None:
    """The core's ``require_trust`` is the one ``trust_pickle`` gate (PermissionError); the
    adapter never tests the value itself."""
    from shardkeeper.core.state import unpickle as legacy

    assert own_trust_checks(PACKAGE) == []
    assert own_trust_checks(Path(legacy.__file__).parent)  # the scan sees the gate's own test
