"""The core touches torch's private names in one module, ``state/_torch_compat.py``, so that a
torch upgrade that moves one breaks that module alone (``tests/core/state/test_torch_compat.py``
names the symbol). The scan is ``tests/private_access.py``'s, the one that holds the adapters to
their ``_internals`` module."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import shardkeeper.core
from tests.private_access import core_private_accesses, framework_private_accesses

CORE = Path(shardkeeper.core.__file__).parent
INTERNALS = "state/_torch_compat.py"


def _torch_private_names() -> set[str]:
    """The private attributes of the torch objects the core handles: tensors, DTensors,
    modules and optimizers (what ``t._x`` on a value of unknown type can reach)."""
    classes = (torch.Tensor, DTensor, torch.nn.Module, torch.optim.Optimizer)
    return {n for c in classes for n in dir(c) if n.startswith("_") and not n.endswith("__")}


def test_only_torch_compat_touches_torch_privates() -> None:
    found = framework_private_accesses(CORE, "torch", _torch_private_names(), internals=INTERNALS)
    assert not found, (
        f"private torch names used outside {INTERNALS}; give each a function there (and its symbol a "
        "line in tests/core/state/test_torch_compat.py):\n" + "\n".join(found)
    )


def test_the_scan_sees_the_privates_of_torch_compat() -> None:
    """The same scan over ``_torch_compat`` itself finds its private names: it can see them."""
    found = framework_private_accesses(CORE, "torch", _torch_private_names(), only=INTERNALS)
    text = "\n".join(found)
    for name in ("_StridedShard", "_get_default_store", "_local_tensor"):
        assert name in text, f"{name} not found by the scan in {INTERNALS}:\n{text}"


def test_the_tools_read_no_private_name_of_the_rest_of_the_core() -> None:
    """The tools (the preemption guard, the importers, export) use the manager they are handed
    through its public members, as an adapter does: the adapters' scan over ``tools/`` as a
    package of its own. ``_torch_compat`` is the one module for torch's privates, which any
    core module may import."""
    found = core_private_accesses(CORE / "tools", "shardkeeper.core.tools", CORE)
    found = [f for f in found if not f.endswith(" import _torch_compat")]
    assert not found, "private names of the core's objects read in tools/:\n" + "\n".join(found)


def test_the_scan_takes_os_exit_for_the_public_function_it_is(tmp_path: Path) -> None:
    """``os._exit`` is documented API (the one exit a thread may take without cleanup), unlike
    another private name of ``os`` or of an object of the core."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "tool.py").write_text(
        "import os\ndef f(mgr):\n    os._exit(1)\n    return os._wrap_close, mgr._pending\n"
    )
    assert core_private_accesses(package, "pkg", CORE) == ["tool.py:4: os._wrap_close", "tool.py:4: mgr._pending"]
