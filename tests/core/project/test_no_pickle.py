"""Nothing of the package pickles or unpickles, but the one gate of the legacy importers
(``state/unpickle.py``, which runs only with ``trust_pickle=True``): the format, the restore
and the persist channel (JSON, ``persist/records.py``) never do."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3] / "packages"
GATE = "core/src/shardkeeper/core/state/unpickle.py"
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(str(node.module))
        elif isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") == "torch":
            found.append("torch.load")
    return found


def test_only_the_legacy_importers_gate_unpickles() -> None:
    offenders = {}
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        rel = path.relative_to(PACKAGES).as_posix()
        uses = _uses(ast.parse(path.read_text()))
        if uses and rel != GATE:
            offenders[rel] = uses
    assert not offenders, offenders
    assert _uses(ast.parse((PACKAGES / GATE).read_text())), "the gate moved: update this test"
