"""Without torch, the torch-side names of ``shardkeeper.core`` say which extra to install.

Each check runs in a fresh interpreter where torch (and numpy) are made unimportable with a
``None`` entry in ``sys.modules``, which is what Python does for a module that is not installed
as far as the import system is concerned (``ModuleNotFoundError`` with ``name`` set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardkeeper.core

SOURCES = str(Path(shardkeeper.core.__file__).parents[2])  # the sources under test

_PROBE = r"""
import json, sys
for blocked in sys.argv[2].split(","):
    if blocked:
        sys.modules[blocked] = None
try:
    exec("from shardkeeper.core import " + sys.argv[1])
except ImportError as exc:
    print(json.dumps({"type": type(exc).__name__, "name": exc.name, "message": str(exc),
                      "module_not_found": isinstance(exc, ModuleNotFoundError)}))
else:
    print(json.dumps(None))
"""

#: Lazy names that need the [torch] extra (torch, or numpy which it brings).
TORCH_SIDE = (
    "CheckpointManager",
    "SaveHandle",
    "Fragment",
    "PerRank",
    "RNGState",
    "normalize_fqn",
    "dtype_from_name",
    "export_safetensors",
    "import_dcp",
    "import_hf",
    "load_hf",
    "quantized",
    "ResumableDistributedSampler",
    "LogicalPartial",
    "logical_combine",
    "logical_digest",
    "logical_partial",
)
#: Lazy names that work without torch (options, settings, advisor, catalog, keys, preemption).
TORCH_FREE = tuple(sorted(set(shardkeeper.core._LAZY) - set(TORCH_SIDE)))


def _probe(name: str, blocked: str) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCES, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, name, blocked], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", TORCH_SIDE)
def test_torch_side_name_without_torch_names_the_extra(name: str) -> None:
    err = _probe(name, "torch,numpy")
    assert err is not None, f"{name} imported without torch: move it to TORCH_FREE"
    assert err["module_not_found"], err  # still a ModuleNotFoundError, so an ImportError
    assert err["name"] in ("torch", "numpy"), err
    message = err["message"]
    assert f"shardkeeper.core.{name} needs {err['name']}" in message, message
    assert "pip install 'shardkeeper-core[torch]'" in message and "torch==2.13.0" in message, message


def test_the_hint_names_torch_when_only_torch_is_missing() -> None:
    err = _probe("CheckpointManager", "torch")
    assert err is not None and err["name"] == "torch", err
    assert "CheckpointManager needs torch" in err["message"], err


@pytest.mark.parametrize("name", TORCH_FREE)
def test_torch_free_name_imports_without_torch(name: str) -> None:
    assert _probe(name, "torch,numpy") is None


def test_another_missing_module_is_not_dressed_up_as_the_torch_extra() -> None:
    """A missing dependency other than torch/numpy inside a lazy import keeps its own error."""
    err = _probe("CheckpointManager", "xxhash")
    assert err is not None and err["type"] == "ModuleNotFoundError", err
    assert err["name"] == "xxhash", err
    assert "shardkeeper-core[torch]" not in err["message"], err
