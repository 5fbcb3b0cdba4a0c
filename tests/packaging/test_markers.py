"""Every test module that launches processes marks them ``multiprocess``.

The noxfile runs each suite as two pytest runs at once on CI's 2 cores: the ``multiprocess``
tests one after another, the others beside them. A launching test left unmarked would run
next to another launch and double the load its timeouts were sized for. This reads the
sources (no imports: it runs in the core suite, where no framework is installed).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: Calls that start processes (tests/launch.py, tests/exit_check.py).
LAUNCHERS = {"run_script", "saved_at_exit", "run_python"}


def _marked(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "multiprocess" for n in ast.walk(node))


def _launches(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            if name in LAUNCHERS:
                return True
    return False


def _unmarked_launchers(path: Path) -> list[str]:
    """The tests of ``path`` that launch processes (or use a fixture that does) unmarked."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_marked = any(
        isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in s.targets) and _marked(s.value)
        for s in tree.body
    )
    if module_marked:
        return []
    fixtures = {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and _launches(f)
        and any("fixture" in ast.unparse(d) for d in f.decorator_list)
    }
    bad = []
    for f in tree.body:
        if not (isinstance(f, ast.FunctionDef) and f.name.startswith("test_")):
            continue
        uses = {a.arg for a in f.args.args} & fixtures
        if (_launches(f) or uses) and not any(_marked(d) for d in f.decorator_list):
            bad.append(f"{path.name}::{f.name}")
    return bad


def test_every_test_that_launches_processes_is_marked_multiprocess() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 50, f"found only {len(modules)} test modules under {TESTS}"
    bad = [f"{path.parent.name}/{name}" for path in modules for name in _unmarked_launchers(path)]
    assert not bad, f"launch processes without @pytest.mark.multiprocess: {bad}"


def test_the_check_sees_an_unmarked_launch(tmp_path: Path) -> None:
    f = tmp_path / "test_x.py"
    f.write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef run():\n    return run_script(2, 'w.py')\n\n"
        "def test_a():\n    run_script(2, 'w.py')\n\n"
        "def test_b(run):\n    pass\n\n"
        "@pytest.mark.multiprocess\ndef test_c(run):\n    saved_at_exit('s.py')\n\n"
        "def test_d():\n    pass\n"
    )
    assert _unmarked_launchers(f) == ["test_x.py::test_a", "test_x.py::test_b"]
