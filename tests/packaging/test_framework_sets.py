"""The adapters' test sets come from their verified ranges and from the index, not from pins:
the newest set asks pip for each framework unpinned (what a plain install gets), the older set
for the lowest minor of each ``TESTED_RANGE``, and every range the noxfile reads is there.

The noxfile's functions run here with a stand-in for the ``nox`` module (only its decorators
and ``options`` are touched at import); nox itself is not installed in the test suites.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def noxfile() -> types.ModuleType:
    stand_in = types.ModuleType("nox")
    stand_in.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stand_in.session = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)  # type: ignore[attr-defined]
    stand_in.parametrize = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    stand_in.Session = object  # type: ignore[attr-defined]
    saved = sys.modules.get("nox")
    sys.modules["nox"] = stand_in
    try:
        spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        if saved is None:
            sys.modules.pop("nox", None)
        else:
            sys.modules["nox"] = saved


def test_the_newest_set_pins_no_framework(noxfile: types.ModuleType) -> None:
    newest = noxfile.framework_requirements("newest")
    assert set(newest) == {"deepspeed", "lightning", "accelerate", "transformers"}, newest


def test_the_older_set_is_the_lowest_minor_of_each_verified_range(noxfile: types.ModuleType) -> None:
    older = dict(re.match(r"([a-z]+)(.*)", r).groups() for r in noxfile.framework_requirements("older"))  # type: ignore[union-attr]
    for adapter, (dist, path) in noxfile.GATES.items():
        source = (ROOT / path).read_text()
        low = re.search(r"^TESTED_RANGE = \(\((\d+), (\d+)\)", source, re.M)
        assert low, f"{path} holds no TESTED_RANGE"
        if adapter in noxfile.OLDER_IS_NEWEST:
            assert older[dist] == "", older
        else:
            assert older[dist] == f"=={low.group(1)}.{low.group(2)}.*", older


def test_every_adapter_has_a_gate(noxfile: types.ModuleType) -> None:
    assert set(noxfile.GATES) == set(noxfile.ADAPTERS)
    for adapter in noxfile.GATES:
        low, high = noxfile.tested_range(adapter)
        assert low < high and len(low) == len(high) == 2
