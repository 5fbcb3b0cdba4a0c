"""In-process units of the DeepSpeed adapter: tag -> step, the mismatch report, client state."""

from __future__ import annotations

import pytest
import torch

from shardkeeper.core import Fragment, StateMismatchError
from shardkeeper.core.format.records import LeafRecord
from shardkeeper.deepspeed.hook import _lists_back, _rebuild, check_model_matches, tag_to_step


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
    state = {"model": _Model({
        "a.weight": Fragment(torch.zeros(3), (4, 5), 6),
        "b.bias": torch.zeros(2),
        "new.weight": torch.zeros(1),
    })}
    leaves = {
        "model/a.weight": LeafRecord("tensor", "float32", (4, 6)),
        "model/b.bias": LeafRecord("tensor", "float32", (2,)),
        "model/old.weight": LeafRecord("tensor", "float32", (1,)),
        "optim/param_groups": LeafRecord("object", value=[]),
    }
    with pytest.raises(StateMismatchError) as e:
        check_model_matches(state, leaves, where="ROOT/step-1 (step 1)")
    msg = str(e.value)
    for want in ("ROOT/step-1", "rank 0", "model/new.weight", "model/old.weight",
                 "model/a.weight: checkpoint shape [4, 6], engine shape [4, 5]"):
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
