"""A checkpoint restored into a model built otherwise than the saved one: refused before a byte
is read, naming the keys, the step and the remedy, where a restore would otherwise mix values
silently or fail inside torch with the model already overwritten.

- A model saved untied (its embedding and output head two tensors) restored into one that
  ties them: both saved tensors were copied into the one tied tensor, the head's last, so the
  embedding silently took the head's values.
- An optimizer saved over other parameters than the target's (untied, or other parameters
  trainable): torch failed on the parameter the target lacks ("Missing optimizer state"),
  after the model had been restored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager, StateMismatchError
from tests.checks import assert_same_state

pytestmark = pytest.mark.timeout(120)


class _LM(nn.Module):
    """An embedding and an output head, tied (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) or not."""

    def __init__(self, *, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(x))


def _trained(*, tied: bool, frozen: bool = False) -> tuple[_LM, torch.optim.Optimizer]:
    model = _LM(tied=tied)
    if frozen:
        model.wte.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.arange(16)).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_an_untied_checkpoint_into_a_tied_model_is_refused_before_reading(
    tmp_path: Path, compression: str | None
) -> None:
    saved, _ = _trained(tied=False)
    opts = {"compression": compression} if compression else {}
    with CheckpointManager(tmp_path, **opts) as mgr:
        mgr.save(1, {"model": saved}).wait()
        target = _LM(tied=True, seed=5)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": target})
        msg = str(e.value)
        assert "'model/wte.weight' and 'model/head.weight'" in msg and "saved with different values" in msg, msg
        assert "step 1" in msg and "rank 0" in msg and str(tmp_path) in msg and "nothing was read" in msg, msg
        assert "tie_word_embeddings=False" in msg and "only=" in msg, msg
        assert_same_state(target.state_dict(), before, what="the tied model (nothing may be read)")
        # the remedy: one name of the group
        assert mgr.restore({"model": target}, only=["model/wte.weight"]) == 1
        assert torch.equal(target.wte.weight, saved.wte.weight) and target.head.weight is target.wte.weight
        # the model built as saved restores whole
        untied = _LM(tied=False, seed=5)
        assert mgr.restore({"model": untied}) == 1
        assert_same_state(untied.state_dict(), saved.state_dict(), what="the untied model")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_tied_checkpoint_listing_both_names_restores_strictly(tmp_path: Path, compression: str | None) -> None:
    """A tied model's ``state_dict()`` lists its weight under both names, the same bytes: the
    check compares content ids, so it passes, and both names hold the saved weight."""
    saved, opt = _trained(tied=True)
    opts = {"compression": compression} if compression else {}
    with CheckpointManager(tmp_path, **opts) as mgr:
        mgr.save(1, {"model": saved, "optim": opt}).wait()
        assert {"model/wte.weight", "model/head.weight"} <= set(mgr.manifest(1).leaves)
        target = _LM(tied=True, seed=5)
        topt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        assert mgr.restore({"model": target, "optim": topt}) == 1
    assert target.head.weight is target.wte.weight
    assert_same_state(
        {"model": target.state_dict(), "optim": topt.state_dict()},
        {"model": saved.state_dict(), "optim": opt.state_dict()},
    )


@pytest.mark.parametrize(
    ("saved_tied", "saved_frozen", "extra", "lacks"),
    [(False, False, "head.weight", None), (False, True, None, "wte.weight")],
    ids=["untied-into-tied", "frozen-into-trainable"],
)
def test_an_optimizer_over_other_parameters_is_refused_before_reading(
    tmp_path: Path, saved_tied: bool, saved_frozen: bool, extra: str | None, lacks: str | None
) -> None:
    saved, opt = _trained(tied=saved_tied, frozen=saved_frozen)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": saved, "optim": opt}).wait()
        target = _LM(tied=extra is not None, seed=5)
        topt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": target, "optim": topt})
        msg = str(e.value)
        assert "'optim'" in msg and "saved over other parameters" in msg and "param group 0" in msg, msg
        if extra:
            assert f"holds {extra}, which the target's lacks" in msg, msg
        if lacks:
            assert f"lacks the target's {lacks}" in msg, msg
        assert "step 1" in msg and "nothing was read" in msg and "only=['model/*']" in msg, msg
        assert_same_state(target.state_dict(), before, what="the model (nothing may be read)")
        moments = [v for st in topt.state.values() for k, v in st.items() if k.startswith("exp_avg")]
        assert all(not v.any() for v in moments), "the optimizer took state from a refused restore"
        if lacks:  # the remedy: the model alone
            assert mgr.restore({"model": target}, only=["model/*"]) == 1
            assert_same_state(target.state_dict(), saved.state_dict(), what="the model restored alone")


def test_a_frozen_parameter_only_the_target_optimizer_lists_restores(tmp_path: Path) -> None:
    """A DeepSpeed engine's optimizer holds only the trainable parameters; a plain optimizer
    built over ``model.parameters()`` lists a frozen one too, which has no state to restore:
    that is no mismatch, and the rest restores bit for bit."""
    saved, opt = _trained(tied=False, frozen=True)  # wte frozen: not in the saved optimizer
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": saved, "optim": opt}).wait()
        target = _LM(tied=False, seed=5)
        target.wte.weight.requires_grad_(False)
        topt = torch.optim.AdamW(target.parameters(), lr=1e-2)  # lists the frozen wte too
        assert mgr.restore({"model": target, "optim": topt}, only=["model/*", "optim/*"]) == 1
    assert_same_state(target.state_dict(), saved.state_dict(), what="the model")
    assert torch.equal(topt.state[target.head.weight]["exp_avg"], opt.state[saved.head.weight]["exp_avg"])


def test_one_tensor_under_two_keys_of_a_plain_dict(tmp_path: Path) -> None:
    """A target that lists one tensor object under two keys (no module): two different saved
    values are refused before a read (the last copy would win); equal ones, or one of the
    names alone, restore into it."""
    a, b = torch.arange(6.0), torch.arange(6.0) * 2
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": {"a": a, "b": b}}).wait()
        mgr.save(2, {"w": {"a": a, "b": a.clone()}}).wait()
        mgr.save(3, {"w": {"a": b}}).wait()
        t = torch.zeros(6)
        with pytest.raises(StateMismatchError, match=r"'w/a' and 'w/b' are one tensor in the target"):
            mgr.restore({"w": {"a": t, "b": t}}, step=1)
        assert not t.any(), "nothing may be read"
        assert mgr.restore({"w": {"a": t, "b": t}}, step=2) == 2 and torch.equal(t, a)
        assert mgr.restore({"w": {"a": t, "b": t}}, step=3) == 3 and torch.equal(t, b)  # b fills through a


def test_tie_groups_that_share_a_key_are_joined() -> None:
    from shardkeeper.core.state.tied import merge_ties

    assert merge_ties([("a", "b"), ("c", "d"), ("b", "c"), ("e", "f")]) == [("a", "b", "c", "d"), ("e", "f")]
    assert merge_ties([("a", "b"), ("b", "a"), ("x",)]) == [("a", "b")]
