"""Every exception class of the core is defined in ``errors.py``, as its docstring says: a scan
of the core's modules finds no other class that derives, directly or through other classes,
from a builtin exception. Warning categories are not errors: they stay beside what warns."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import shardkeeper.core

CORE = Path(shardkeeper.core.__file__).parent
#: Exception classes another change moves into errors.py (``errors.py``'s docstring names them):
#: name -> where it is defined. Remove an entry once its class is defined nowhere else.
PENDING: dict[str, str] = {}


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""


def _exception_classes(root: Path) -> dict[str, set[str]]:
    """Each exception class (not a warning category) of the modules under ``root``, by name:
    the modules (paths relative to ``root``) that define one of that name."""
    defined: list[tuple[str, str, list[str]]] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [_base_name(b) for b in node.bases]
                defined.append((path.relative_to(root).as_posix(), node.name, bases))
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    warning = {n for n in builtin if issubclass(getattr(builtins, n), Warning)}
    exceptions, warnings = builtin - warning, set(warning)
    grown = True
    while grown:  # through classes of the core that derive from other classes of the core
        grown = False
        for _, name, bases in defined:
            if name not in warnings and any(b in warnings for b in bases):
                warnings.add(name)
                grown = True
            elif name not in exceptions and any(b in exceptions for b in bases):
                exceptions.add(name)
                grown = True
    found: dict[str, set[str]] = {}
    for where, name, bases in defined:
        if any(b in exceptions for b in bases) and not any(b in warnings for b in bases):
            found.setdefault(name, set()).add(where)
    return found


def test_every_exception_class_of_the_core_is_defined_in_errors() -> None:
    elsewhere = {
        f"{where}: {name}"
        for name, wheres in _exception_classes(CORE).items()
        for where in wheres
        if where != "errors.py" and name not in PENDING
    }
    assert not elsewhere, "exception classes defined outside errors.py (move them there): " + ", ".join(
        sorted(elsewhere)
    )


def test_each_pending_class_is_still_defined_outside_errors() -> None:
    found = _exception_classes(CORE)
    stale = [name for name in PENDING if not found.get(name, set()) - {"errors.py"}]
    assert not stale, f"remove these entries of PENDING (and their words in errors.py): {stale}"


def test_the_scan_finds_classes_through_their_bases_and_leaves_warnings_out() -> None:
    found = _exception_classes(CORE)
    assert found["CheckpointError"] == {"errors.py"}
    assert found["StartRefusedError"] == {"errors.py"}  # through StepOrderError, CommitConflictError
    assert "IneffectiveOptionWarning" not in found and "UnwaitedSaveWarning" not in found
