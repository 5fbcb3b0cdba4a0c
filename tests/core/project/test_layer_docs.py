"""The layer table in docs/api.md and the package map in the core's README say what the
import-linter contract enforces: the same packages, in the same order, and every package of the
core in both."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

import shardkeeper.core

REPO = Path(__file__).resolve().parents[3]
CORE = Path(shardkeeper.core.__file__).parent


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c.get("containers") == ["shardkeeper.core"]
    ]
    return [{name.strip() for name in layer.split("|")} for layer in contract["layers"]]


def _doc_layers() -> list[set[str]]:
    text = (REPO / "docs" / "api.md").read_text()
    section = text[text.index("## Layers") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    return [set(re.findall(r"`(\w+)`", row.split("|")[2])) for row in rows]


def _core_packages() -> set[str]:
    packages = {p.parent.name for p in CORE.glob("*/__init__.py")}
    modules = {p.stem for p in CORE.glob("*.py") if p.stem != "__init__"}
    return packages | modules


def test_the_api_layer_table_is_the_contract() -> None:
    assert _doc_layers() == _contract_layers()


def test_every_core_package_is_in_a_layer_and_on_the_map() -> None:
    layered = set().union(*_contract_layers())
    assert layered == _core_packages(), "in no layer: " + str(sorted(_core_packages() - layered))
    readme = (CORE / "README.md").read_text()
    mapped = set(re.findall(r"`(\w+)/`", readme)) | set(re.findall(r"`(\w+)\.py`", readme))
    assert mapped == _core_packages()


def test_the_core_top_level_holds_at_most_five_modules() -> None:
    modules = sorted(p.name for p in CORE.glob("*.py"))
    assert len(modules) <= 5, modules
