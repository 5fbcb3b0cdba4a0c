"""The module layering: every module of the core imports on its own, whatever was imported
before it, and no package under ``packages/`` (the core, each adapter) has an import cycle.

Two checks, because each catches what the other cannot: a fresh interpreter importing every
module of ``shardkeeper.core`` (alphabetically, then in reverse) finds a cycle that breaks at
import time, which depends on which module comes first; a static scan of every ``import`` and
``from`` statement (module-level, inside functions and under ``TYPE_CHECKING`` alike) finds a
cycle that only works because its imports are deferred or type-only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

import shardkeeper.core

CORE = Path(shardkeeper.core.__file__).parent
REPO = Path(__file__).resolve().parents[3]
#: The packages whose modules must form no import cycle (with each other or through any other
#: module of the core).
LAYERED = ("shardkeeper.core.format", "shardkeeper.core.storage", "shardkeeper.core.codec")


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (whose directory is ``root``), by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = path
    return out


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, from every import statement in it."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                for a in node.names:
                    if f"{source}.{a.name}" in modules:  # a submodule: from pkg import mod
                        graph[name].add(f"{source}.{a.name}")
                    elif source in modules:
                        graph[name].add(source)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``component`` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of its component")  # pragma: no cover


def _layered(names: Iterable[str]) -> bool:
    return any(n == p or n.startswith(p + ".") for n in names for p in LAYERED)


@pytest.mark.parametrize("order", ["alphabetical", "reverse"])
def test_every_core_module_imports_in_a_fresh_interpreter(order: str) -> None:
    # ``__main__`` modules are entry points: importing one runs its command
    names = sorted(
        (n for n in _modules(CORE, "shardkeeper.core") if not n.endswith(".__main__")), reverse=order == "reverse"
    )
    code = textwrap.dedent(
        """
        import importlib, json, sys, traceback
        failed = []
        for name in json.loads(sys.argv[1]):
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(f"{name}: {traceback.format_exc(limit=-3)}")
        print(json.dumps(failed))
        """
    )
    res = subprocess.run([sys.executable, "-c", code, json.dumps(names)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert not failed, f"{len(failed)} of {len(names)} modules fail to import ({order}):\n" + "\n".join(failed)


def test_format_storage_and_codec_form_no_import_cycle() -> None:
    graph = _import_graph(CORE, "shardkeeper.core")
    assert "shardkeeper.core.format.manifest" in graph and graph["shardkeeper.core.format.manifest"]
    cycles = [c for c in _cycles(graph) if _layered(c)]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _packages() -> dict[str, Path]:
    """Every package under ``packages/`` (the core and each adapter): dotted name -> directory."""
    return {
        f"shardkeeper.{p.parent.name}": p.parent for p in sorted(REPO.glob("packages/*/src/shardkeeper/*/__init__.py"))
    }


def test_no_package_has_an_import_cycle() -> None:
    """The core and each adapter, scanned as the core is: an adapter's modules form no cycle
    either (across packages, the import-linter contracts hold the adapters above the core and
    apart from each other)."""
    packages = _packages()
    assert {"shardkeeper.core", "shardkeeper.lightning", "shardkeeper.deepspeed"} <= set(packages), packages
    cycles = [c for name, root in packages.items() for c in _cycles(_import_graph(root, name))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_scan_finds_cycles_through_function_level_and_type_only_imports(tmp_path: Path) -> None:
    """The scan itself: a cycle hidden in a function body or under TYPE_CHECKING is reported
    with its path, a one-way import is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = _import_graph(pkg, "pkg")
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "c.py").write_text("")
    assert _cycles(_import_graph(pkg, "pkg")) == []
