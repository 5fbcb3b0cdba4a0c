"""The line between the core's public surface and its internals, as the adapters meet it: no
adapter, and not the core's own adapter contract, reads a private name of the core's objects
(a manager's ``_coord``: ``mgr.agree`` is the collective they need). Which core modules they may
import at all is an import-linter contract (pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.private_access import core_private_accesses

REPO = Path(__file__).resolve().parents[3]
CORE = REPO / "packages" / "core" / "src" / "shardkeeper" / "core"
#: Each adapter and its internals module (where framework privates belong).
ADAPTERS = {
    "deepspeed": "_ds_internals.py",
    "lightning": "_internals.py",
    "accelerate": "_internals.py",
    "transformers": "_internals.py",
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_an_adapter_reads_no_private_name_of_the_core(name: str) -> None:
    package = REPO / "packages" / f"{name}_plugin" / "src" / "shardkeeper" / name
    assert core_private_accesses(package, f"shardkeeper.{name}", CORE, ADAPTERS[name]) == []


def test_the_adapter_contract_reads_no_private_name_of_the_rest_of_the_core() -> None:
    assert core_private_accesses(CORE / "adapter", "shardkeeper.core.adapter", CORE) == []


def test_the_scan_sees_the_private_names_of_the_cores_objects(tmp_path: Path) -> None:
    """The scan cannot pass by seeing nothing: a manager built by a core callable, a parameter
    annotated with one, and a core private name in the internals module are each reported; the
    package's own privates and a framework's private in the internals module are not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "plugin.py").write_text(
        "from shardkeeper.core import CheckpointManager\n"
        "from pkg import _internals\n"
        "class Own:\n"
        "    def f(self, mgr: CheckpointManager):\n"
        "        return self._x, mgr._coord\n"
        "def g(root):\n"
        "    m = CheckpointManager(root)\n"
        "    o = Own()\n"
        "    return m._pending, o._x, _internals._helper\n"
    )
    (package / "_internals.py").write_text("def h(trainer, mgr):\n    return trainer._framework_name, mgr._saver\n")
    found = core_private_accesses(package, "pkg", CORE, "_internals.py")
    assert found == ["plugin.py:5: mgr._coord", "plugin.py:9: m._pending", "_internals.py:2: mgr._saver"]


def test_agree_is_the_managers_collective_for_adapters(tmp_path: Path) -> None:
    """``mgr.agree``: rank 0's value, or the largest or smallest (one rank here: its own);
    anything but an int, or another op, is refused naming the root and rank."""
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, async_save=False)
        assert [mgr.agree(7), mgr.agree(7, "max"), mgr.agree(-3, "min")] == [7, 7, -3]
        with pytest.raises(TypeError, match=r"agree\(\): value must be an int, not bool \(root .*root, rank 0\)"):
            mgr.agree(True)
        with pytest.raises(ValueError, match=r"op must be 'bcast', 'max' or 'min', got 'sum' \(root .*, rank 0\)"):
            mgr.agree(1, "sum")
