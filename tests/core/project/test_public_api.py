"""The public API (docs/api.md): what the documentation imports is public, and what is public exists.

Every ``from shardkeeper... import X`` and ``import shardkeeper...`` in a python code block of
README.md and docs/*.md, and in demo/*.py, must name a public package and a name in its
``__all__``; every name in a public ``__all__`` must resolve. The adapters' packages are read as
source (their frameworks are not installed in the core's suite); the core's are imported.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

#: The core's public packages: their ``__all__`` is the core's public API.
CORE_PUBLIC = (
    "shardkeeper.core",
    "shardkeeper.core.storage",
    "shardkeeper.core.testing",
    "shardkeeper.core.testing.storage_conformance",
)
#: The adapters' top-level packages, by source file.
ADAPTERS = {
    f"shardkeeper.{name}": REPO / "packages" / f"{name}_plugin" / "src" / "shardkeeper" / name / "__init__.py"
    for name in ("deepspeed", "lightning", "accelerate", "transformers")
}

_FENCE = re.compile(r"^```(?:python|py)[^\n]*\n(.*?)^```", re.S | re.M)
_FROM = re.compile(r"^\s*from\s+(shardkeeper[\w.]*)\s+import\s+\(?([\w\s,]+)\)?", re.M)
_IMPORT = re.compile(r"^\s*import\s+([\w.,\s]+)$", re.M)


def _samples() -> list[tuple[str, str]]:
    """(where, code): each python code block of README.md and docs/*.md, and each demo script."""
    out = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = md.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{md.relative_to(REPO)}:{line}", m.group(1)))
    for py in sorted((REPO / "demo").glob("*.py")):
        out.append((str(py.relative_to(REPO)), py.read_text()))
    return out


def _imports(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for each shardkeeper import in ``code``; name is None for ``import module``.
    Parsed as Python where the sample parses (it may hold ``...`` placeholders that do not)."""
    found: list[tuple[str, str | None]] = []
    try:
        tree = ast.parse(code)
    except SyntaxError:
        for m in _FROM.finditer(code):
            found += [(m.group(1), n.split(" as ")[0].strip()) for n in m.group(2).split(",") if n.strip()]
        for m in _IMPORT.finditer(code):
            found += [(n.split(" as ")[0].strip(), None) for n in m.group(1).split(",")]
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None) for a in node.names]
    return [(mod, name) for mod, name in found if mod == "shardkeeper" or mod.startswith("shardkeeper.")]


def _literal_all(source: Path) -> list[str]:
    """The ``__all__`` assigned at the top level of ``source``, read without importing it."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None
            value = ast.literal_eval(node.value)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), source
            return value
    raise AssertionError(f"{source} has no literal __all__")


def _core_all(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def _public_all() -> dict[str, list[str]]:
    """Each public module and its ``__all__``; a submodule that a public ``__all__`` names
    (``from shardkeeper.core import metrics``) is public with its own ``__all__``."""
    out = {m: _core_all(m) for m in CORE_PUBLIC}
    out.update({m: _literal_all(path) for m, path in ADAPTERS.items()})
    for m in CORE_PUBLIC:
        for name in out[m]:
            if _is_submodule(f"{m}.{name}"):
                out[f"{m}.{name}"] = _core_all(f"{m}.{name}")
    return out


def _is_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_the_samples_are_found() -> None:
    """The scan sees the README's own first import: it cannot pass by finding nothing."""
    imports = {(mod, name) for _, code in _samples() for mod, name in _imports(code)}
    assert ("shardkeeper.core", "CheckpointManager") in imports
    assert ("shardkeeper.lightning", "ShardkeeperCheckpointIO") in imports
    assert ("shardkeeper.deepspeed", None) in imports


def test_documented_imports_are_public() -> None:
    public = _public_all()
    bad = []
    for where, code in _samples():
        for mod, name in _imports(code):
            if mod not in public:
                bad.append(f"{where}: {mod} is internal (public: {', '.join(sorted(public))})")
            elif name is not None and name not in public[mod]:
                bad.append(f"{where}: {name} is not in {mod}.__all__")
    assert not bad, "documentation imports internal names; re-export them or fix the docs:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", CORE_PUBLIC)
def test_every_core_public_name_exists(module: str) -> None:
    names = _core_all(module)
    assert len(names) == len(set(names)), f"{module}.__all__ repeats a name"
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"


def _bound_names(source: Path) -> dict[str, tuple[str, str] | None]:
    """Top-level names of ``source``: (module, name) for an absolute ``from`` import, else None."""
    bound: dict[str, tuple[str, str] | None] = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = None
        elif isinstance(node, ast.Assign):
            bound.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound[node.target.id] = None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            bound.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        elif isinstance(node, ast.Import):
            bound.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    return bound


@pytest.mark.parametrize("module", sorted(ADAPTERS))
def test_every_adapter_public_name_exists(module: str) -> None:
    """Read as source: each name in the adapter's ``__all__`` is bound in its ``__init__``, and
    one it imports from a sibling module is defined there."""
    source = ADAPTERS[module]
    names = _literal_all(source)
    assert len(names) == len(set(names)), f"{module}.__all__ repeats a name"
    bound = _bound_names(source)
    bad = []
    for name in names:
        if name not in bound:
            bad.append(f"{name}: not bound in {source.relative_to(REPO)}")
            continue
        origin = bound[name]
        if origin is not None and origin[0].startswith(module + "."):
            sibling = source.parent / (origin[0][len(module) + 1 :].replace(".", "/") + ".py")
            if origin[1] not in _bound_names(sibling):
                bad.append(f"{name}: {origin[0]} has no {origin[1]}")
    assert not bad, f"{module}.__all__:\n" + "\n".join(bad)


def test_every_module_of_every_package_says_what_it_exports() -> None:
    """``__all__`` in every module of the core and the adapters (the public/internal line is drawn
    on those lists)."""
    missing = []
    for path in sorted((REPO / "packages").glob("*/src/shardkeeper/**/*.py")):
        if not any(line.startswith("__all__") for line in path.read_text().splitlines()):
            missing.append(str(path.relative_to(REPO)))
    assert not missing, missing
