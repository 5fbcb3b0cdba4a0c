"""The shared judges of every suite (tests/checks.py): the full-state compare must see every kind
of difference and name it, and the check recorder must carry every failure to the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.checks import Checks, assert_checks, assert_same_state, read_checks, state_diff, state_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([1.5, 2.5]))
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale + self.frozen


def _trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    return net, opt


def test_state_of_keys_params_buffers_and_optimizer_state_by_fqn() -> None:
    net, opt = _trained()
    st = state_of(net, opt)
    assert {"param/fc.weight", "param/fc.bias", "param/frozen", "buffer/scale"} <= set(st)
    assert {"optim/fc.weight/exp_avg", "optim/fc.weight/exp_avg_sq", "optim/fc.bias/step"} <= set(st)
    assert st["optim/param_groups/0/params"] == ["fc.weight", "fc.bias"] and st["optim/param_groups/0/lr"] == 0.1
    with torch.no_grad():
        net.fc.weight.add_(1.0)
    opt.state[net.fc.weight]["exp_avg"].mul_(2.0)
    later = state_of(net, opt)
    diff = state_diff(later, st)
    assert "param/fc.weight" in diff and "optim/fc.weight/exp_avg" in diff, diff  # the snapshot is a copy
    with pytest.raises(ValueError, match="not a parameter of the model"):
        state_of(nn.Linear(3, 2), opt)


def test_equal_states_have_no_diff_and_resumed_state_matches() -> None:
    net, opt = _trained()
    want = state_of(net, opt)
    net2, opt2 = _trained(seed=5)
    assert state_diff(state_of(net2, opt2), want)  # control: other seeds differ
    net2.load_state_dict(net.state_dict())
    opt2.load_state_dict(opt.state_dict())
    assert state_diff(state_of(net2, opt2), want) == ""
    assert_same_state(state_of(net2, opt2), want)


def test_one_flipped_bit_is_found_and_located() -> None:
    want = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    got = {"w": want["w"].clone()}
    got["w"].view(torch.int32)[2, 1] ^= 1  # the last mantissa bit of one element
    diff = state_diff(got, want)
    assert diff.startswith("1 of 1 wanted keys differ") and "w: 1 of 12 elements differ, first at [2, 1]" in diff, diff
    assert "want 9.0" in diff and "max abs diff" in diff, diff


def test_bit_for_bit_means_bytes_signed_zeros_differ_and_nans_match() -> None:
    assert state_diff({"z": torch.tensor([0.0])}, {"z": torch.tensor([-0.0])})  # torch.equal says equal
    nan = torch.tensor([float("nan"), 1.0])
    assert state_diff({"n": nan.clone()}, {"n": nan}) == ""  # torch.equal says different
    assert state_diff({"f": float("nan")}, {"f": float("nan")}) == ""


def test_every_kind_of_difference_is_named() -> None:
    want = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2, 3), "d": 1, "e": 0.5, "gone": torch.ones(1)}
    got = {
        "a": torch.zeros(2),
        "b": torch.zeros(2, dtype=torch.float64),
        "c": torch.zeros(3, 2),
        "d": 1.0,
        "e": torch.tensor(0.5),
        "new": 3,
    }
    diff = state_diff(got, want)
    lines = dict(line.strip().split(": ", 1) for line in diff.splitlines()[1:])
    assert diff.splitlines()[0] == "5 of 6 wanted keys differ, 1 unexpected", diff
    assert lines["missing"] == "gone" and lines["unexpected"] == "new", diff
    assert "b: got torch.float64, want torch.float32" in lines["dtype"], diff
    assert "c: got [3, 2], want [2, 3]" in lines["shape"], diff
    assert "d: got float 1.0, want int 1" in lines["type"] and "e: got Tensor, want float" in lines["type"], diff
    assert state_diff(got, {"a": torch.zeros(2)}, subset=True) == ""
    assert state_diff({"a": 1}, {}) == "nothing to compare: the wanted state is empty"


def test_nested_states_flatten_and_long_lists_are_cut() -> None:
    want = {"model": {f"l{i}": torch.zeros(1) for i in range(9)}, "groups": [{"lr": 0.1}]}
    got = {"model": {f"l{i}": torch.ones(1) for i in range(9)}, "groups": [{"lr": 0.2}]}
    diff = state_diff(got, want)
    assert "model/l0: 1 of 1 elements differ" in diff and "model/l5" not in diff and diff.endswith("(+5 more)"), diff
    assert state_diff({"groups": got["groups"]}, {"groups": want["groups"]}).endswith("groups/0/lr: got 0.2, want 0.1")
    with pytest.raises(AssertionError, match="the model differs from the wanted one:\n10 of 10 wanted keys differ"):
        assert_same_state(got, want, what="the model")


def test_checks_record_write_and_fail_naming_each_check(tmp_path: Path) -> None:
    checks = Checks(tmp_path / "r1.json", rank=1)
    assert checks.check("fine", True, "never shown")
    assert not checks.check("bad", False, ["a", "b"])
    assert not checks.same("state", {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    assert checks.run("runs through", lambda: None)
    assert not checks.run("raises", lambda: 1 / 0)
    assert checks.guard("a block recording its own checks", lambda: None)
    checks.write()
    other = Checks(rank=0)
    other.check("fine", True, extra_field=7)
    other.write(tmp_path / "r0.json")
    got = read_checks(tmp_path / "r0.json", tmp_path / "r1.json")
    assert [(c["name"], c["ok"], c["rank"]) for c in got] == [
        ("fine", True, 0),
        ("fine", True, 1),
        ("bad", False, 1),
        ("state", False, 1),
        ("runs through", True, 1),
        ("raises", False, 1),
    ]
    assert got[0]["extra_field"] == 7 and "detail" not in got[1]
    with pytest.raises(AssertionError) as info:
        assert_checks(got, ["fine", "runs through"], where="phase x")
    msg = str(info.value)
    assert msg.startswith("phase x: 3 of 6 checks failed, some never ran"), msg
    assert "[rank 1] bad: ['a', 'b']" in msg and "[rank 1] state: 1 of 1 wanted keys differ" in msg, msg
    assert "[rank 1] raises: ZeroDivisionError: division by zero" in msg, msg
    assert "[rank 0] never recorded: ['runs through']" in msg, msg
    assert_checks([c for c in got if c["ok"] and c["rank"] == 1], ["fine", "runs through"])
    with pytest.raises(AssertionError, match="no checks were recorded"):
        assert_checks([])
    with pytest.raises(AssertionError, match="no results written"):
        read_checks(tmp_path / "r2.json", output="the launch's output")


def test_a_recorded_skip_skips_the_test() -> None:
    checks = Checks(rank=0)
    checks.skip("framework_cannot_run", "the framework fails before our code runs")
    with pytest.raises(pytest.skip.Exception, match="framework_cannot_run: the framework fails"):
        assert_checks(checks.items)
