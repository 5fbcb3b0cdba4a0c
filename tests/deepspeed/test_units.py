"""In-process units of the DeepSpeed adapter: tag -> step, the mismatch report, client state,
the settings of the config's "shardkeeper" section, internals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import Fragment, StateMismatchError
from shardkeeper.core.format.records import LeafRecord
from shardkeeper.deepspeed import _ds_internals as dsi
from shardkeeper.deepspeed.hook import (
    _lists_back,
    _rebuild,
    check_model_matches,
    config_settings,
    tag_to_step,
)
from tests.private_access import gate_warnings, internals_accesses, own_trust_checks, private_accesses


@pytest.mark.parametrize(
    ("tag", "step"),
    [(1200, 1200), ("1200", 1200), ("global_step1200", 1200), (None, None), ("best", None), ("global_stepX", None)],
)
def test_tag_to_step(tag: object, step: int | None) -> None:
    assert tag_to_step(tag) == step


class _Model:
    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd


def test_mismatch_lists_every_name_and_shape() -> None:
    state = {
        "model": _Model(
            {
                "a.weight": Fragment(torch.zeros(3), (4, 5), 6),
                "b.bias": torch.zeros(2),
                "new.weight": torch.zeros(1),
            }
        )
    }
    leaves = {
        "model/a.weight": LeafRecord("tensor", "float32", (4, 6)),
        "model/b.bias": LeafRecord("tensor", "float32", (2,)),
        "model/old.weight": LeafRecord("tensor", "float32", (1,)),
        "optim/param_groups": LeafRecord("object", value=[]),
    }
    with pytest.raises(StateMismatchError) as e:
        check_model_matches(state, leaves, where="ROOT/step-1 (step 1)")
    msg = str(e.value)
    for want in (
        "ROOT/step-1",
        "rank 0",
        "model/new.weight",
        "model/old.weight",
        "model/a.weight: checkpoint shape [4, 6], engine shape [4, 5]",
    ):
        assert want in msg, msg
    assert "b.bias" not in msg
    del state["model"].sd["new.weight"], leaves["model/old.weight"]
    leaves["model/a.weight"] = LeafRecord("tensor", "float32", (4, 5))
    check_model_matches(state, leaves, where="x")  # a match raises nothing


def test_client_state_targets_rebuilt_from_the_manifest() -> None:
    leaves = {
        "extra/client_state/iteration": LeafRecord("object", value=3),
        "extra/client_state/ts/0": LeafRecord("tensor", "bfloat16", (2, 3)),
        "extra/client_state/ts/1": LeafRecord("tensor", "float32", ()),
        "model/x": LeafRecord("tensor", "float32", (1,)),
    }
    t = _rebuild("extra/client_state", leaves)
    assert set(t) == {"iteration", "ts"}
    assert t["ts"]["0"].shape == (2, 3) and t["ts"]["0"].dtype == torch.bfloat16
    back = _lists_back(t)
    assert isinstance(back["ts"], list) and len(back["ts"]) == 2
    assert _rebuild("extra/client_state", {"extra/client_state": LeafRecord("object", value={})}) == {"": None}


class _Config:
    def __init__(self, section: object) -> None:
        self._param_dict = {"train_batch_size": 4, "shardkeeper": section}


class _Engine:
    def __init__(self, section: object) -> None:
        self._config = _Config(section)


def test_config_section_is_read_by_the_options_types() -> None:
    """The section's keys convert by CheckpointOptions' declared types (and the hook's own:
    root, retention, storage options, metadata); errors name the section and the key."""
    got = config_settings(
        _Engine(
            {
                "root": "/r",
                "keep_last": 3,
                "async_save": "false",
                "staging": "overlap",
                "storage_options": {"anon": True},
            }
        )
    )
    assert got == {
        "root": "/r",
        "keep_last": 3,
        "async_save": False,
        "staging": "overlap",
        "storage_options": {"anon": True},
    }
    assert config_settings(_Engine(None)) == {}
    section = "the DeepSpeed config's 'shardkeeper' section"
    with pytest.raises(
        ValueError, match=rf"^{section}: unknown setting\(s\) keep_lats \(did you mean keep_last or keep_best\?\)"
    ):
        config_settings(_Engine({"keep_lats": 3}))
    with pytest.raises(ValueError, match=rf"'io_threads' from {section} is 'four', not a valid int"):
        config_settings(_Engine({"io_threads": "four"}))
    with pytest.raises(ValueError, match=rf"^{section} must be a mapping of settings, got list"):
        config_settings(_Engine(["keep_last"]))


def test_persistent_buffers_are_the_state_dict_buffers_of_every_submodule() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("kept", torch.ones(2))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)
            self.register_buffer("unset", None)

    model = torch.nn.Sequential(Block(), torch.nn.BatchNorm1d(2), Block())
    got = dsi.persistent_buffers(model)
    params = {n for n, _ in model.named_parameters()}
    want = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in params}
    assert list(got) == list(want) and all(got[k] is want[k] for k in want)
    assert "0.kept" in got and "1.running_mean" in got and not any("scratch" in k or "unset" in k for k in got)
    assert dsi._non_persistent_set_works()


def test_a_release_outside_the_tested_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed

    inside, outside = gate_warnings(dsi, monkeypatch)
    assert inside == []
    assert outside == [
        f"shardkeeper.deepspeed was verified with DeepSpeed 0.1 to <0.2; {deepspeed.__version__} is outside that range "
        "(its internals passed the checks)"
    ]


def test_private_attributes_are_used_only_in_the_internals_module() -> None:
    package = Path(dsi.__file__).parent
    assert private_accesses(package, "_ds_internals.py") == []
    seen = " ".join(internals_accesses(package, "_ds_internals.py"))
    assert "p._hp_mapping" in seen and "mod._non_persistent_buffers_set" in seen


def test_trust_pickle_is_only_passed_to_the_core_gate() -> None:
    """The core's ``require_trust`` is the one ``trust_pickle`` gate (PermissionError); the
    adapter never tests the value itself."""
    from shardkeeper.core.state import unpickle as legacy

    assert own_trust_checks(Path(dsi.__file__).parent) == []
    assert own_trust_checks(Path(legacy.__file__).parent)  # the scan sees the gate's own test
