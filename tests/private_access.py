"""Static checks that an adapter touches private framework names only in its internals module,
and private names of the core's objects nowhere.

``private_accesses(package_dir, internals)`` parses every module of an adapter package except
``internals`` and lists each use of a private name (``_x``, not ``__x__``) that is not the
adapter's own:

- attribute reads and writes ``obj._x``, and ``getattr`` / ``setattr`` / ``hasattr`` /
  ``delattr`` / ``object.__setattr__`` with a literal (or module-constant) private name;
- ``from framework... import _x``, and imports of a private module path (``a._b``).

Not reported, as the adapter's own: ``self._x`` / ``cls._x`` in methods of the adapter's
classes; ``obj._x`` where ``obj`` is annotated with, or built by calling, one of the adapter's
classes, is one of those classes, or is a ``shardkeeper`` module (module-private names);
attributes named ``_shardkeeper...`` (markers the adapter sets on framework objects to find
its own state again). Nor is a standard-library name that is documented API despite its
underscore (``_DOCUMENTED``: ``os._exit``).

``core_private_accesses(package_dir, package, internals)`` holds the core's objects to the same
line: the same scan with only ``package``'s own imports counted as its own, so a manager or a
handle made by a ``shardkeeper.core`` callable is foreign; and, in ``internals`` (where framework
privates belong), each private name that a class of the core defines.

``framework_private_accesses(package_dir, framework, names, internals=...)`` runs the scan over
a package and its subpackages for one framework's private names alone: the core touches
torch's privates only in ``state/_torch_compat.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

_ATTR_FUNCS = {"getattr", "setattr", "hasattr", "delattr"}
_OBJECT_FUNCS = {"__setattr__", "__getattribute__", "__delattr__"}
#: Standard-library names that start with an underscore yet are documented API, by (module, name):
#: ``os._exit`` is the exit a thread may take at once, without cleanup.
_DOCUMENTED = {("os", "_exit")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str | None, level: int, own: str = "shardkeeper") -> bool:
    """Whether an import is of the scanned code's own (``own``: a package prefix)."""
    name = module or ""
    return level > 0 or name == own or name.startswith(own + ".")


class _Scan(ast.NodeVisitor):
    def __init__(self, own_classes: set[str], consts: dict[str, str], where: str, own: str = "shardkeeper") -> None:
        self.own_classes = own_classes
        self.own = own
        self.consts = consts
        self.where = where
        self.scopes: list[dict[str, bool]] = [{}]
        self.found: list[str] = []

    # -- what a name refers to -------------------------------------------------------------
    def _own(self, node: ast.expr) -> bool:
        if not isinstance(node, ast.Name):
            return False
        for scope in reversed(self.scopes):
            if node.id in scope:
                return scope[node.id]
        return node.id in self.own_classes

    def _names_own_class(self, annotation: ast.expr | None) -> bool:
        return annotation is not None and bool(set(re.findall(r"\w+", ast.unparse(annotation))) & self.own_classes)

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.where}:{getattr(node, 'lineno', 0)}: {what}")

    # -- scopes ----------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for d in node.decorator_list + node.bases + node.keywords:
            self.visit(d)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(stmt, method=True)
            else:
                self.visit(stmt)
        self.scopes[-1][node.name] = True

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._function(node, method=False)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool) -> None:
        for d in node.decorator_list:
            self.visit(d)
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
        for a in args:
            if a.annotation is not None:
                self.visit(a.annotation)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
        scope = {a.arg: self._names_own_class(a.annotation) for a in args}
        positional = node.args.posonlyargs + node.args.args
        if method and not static and positional:
            scope[positional[0].arg] = True  # self / cls of the adapter's own class
        self.scopes.append(scope)
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()
        self.scopes[-1][node.name] = False

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.scopes.append({a.arg: False for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs})
        self.visit(node.body)
        self.scopes.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        built = isinstance(node.value, ast.Call) and self._own(node.value.func)
        for t in node.targets:
            if isinstance(t, ast.Name):
                self.scopes[-1][t.id] = built

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            self.scopes[-1][node.target.id] = self._names_own_class(node.annotation)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            ours = _ours(alias.name, 0, self.own)
            if not ours and any(_private(part) for part in alias.name.split(".")):
                self._report(node, f"import {alias.name}")
            self.scopes[-1][(alias.asname or alias.name).split(".")[0]] = ours

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        ours = _ours(node.module, node.level, self.own)
        if not ours and any(_private(part) for part in (node.module or "").split(".")):
            self._report(node, f"from {node.module} import ...")
        for alias in node.names:
            if not ours and _private(alias.name):
                self._report(node, f"from {node.module} import {alias.name}")
            self.scopes[-1][alias.asname or alias.name] = ours

    # -- the accesses ----------------------------------------------------------------------
    def _check(self, node: ast.AST, obj: ast.expr, name: str) -> None:
        if isinstance(obj, ast.Name) and (obj.id, name) in _DOCUMENTED:
            return
        if _private(name) and not name.startswith("_shardkeeper") and not self._own(obj):
            self._report(node, ast.unparse(node)[:100])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        reflective = (isinstance(f, ast.Name) and f.id in _ATTR_FUNCS) or (
            isinstance(f, ast.Attribute)
            and f.attr in _OBJECT_FUNCS
            and isinstance(f.value, ast.Name)
            and f.value.id == "object"
        )
        if reflective and len(node.args) >= 2:
            arg = node.args[1]
            name = arg.value if isinstance(arg, ast.Constant) else self.consts.get(getattr(arg, "id", ""))
            if isinstance(name, str):
                self._check(node, node.args[0], name)
        self.generic_visit(node)


def _module_consts(tree: ast.Module) -> dict[str, str]:
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            out.update({t.id: stmt.value.value for t in stmt.targets if isinstance(t, ast.Name)})
    return out


def scan_file(path: Path, own_classes: set[str], where: str, own: str = "shardkeeper") -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    s = _Scan(own_classes, _module_consts(tree), where, own)
    s.visit(tree)
    return s.found


def adapter_classes(package_dir: Path) -> set[str]:
    """Names of the classes the adapter package defines."""
    trees = [ast.parse(f.read_text()) for f in package_dir.glob("*.py")]
    return {n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def private_accesses(package_dir: Path, internals: str) -> list[str]:
    """``file:line: code`` of every private-name use outside ``internals`` that is not the adapter's own."""
    own = adapter_classes(package_dir)
    found: list[str] = []
    for f in sorted(package_dir.glob("*.py")):
        if f.name != internals:
            found += scan_file(f, own, f.name)
    return found


def internals_accesses(package_dir: Path, internals: str) -> list[str]:
    """The same findings inside ``internals`` itself (where they belong): shows the scan sees them."""
    return scan_file(package_dir / internals, adapter_classes(package_dir), internals)


def core_private_names(core_dir: Path) -> set[str]:
    """The private names the core's classes define: methods, ``self._x`` and annotated fields."""
    names: set[str] = set()
    for f in sorted(core_dir.rglob("*.py")):
        for cls in ast.walk(ast.parse(f.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for n in ast.walk(cls):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    names.add(n.attr)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
    return {n for n in names if _private(n)}


def core_private_accesses(package_dir: Path, package: str, core_dir: Path, internals: str | None = None) -> list[str]:
    """``file:line: code`` of every use of a private name of the core's objects in ``package``
    (an adapter, or the core's own adapter contract): in each module but ``internals``, every
    private name of an object that is not ``package``'s own (the core's objects, a manager
    included, are not); in ``internals``, each private name a class of the core defines."""
    own = adapter_classes(package_dir)
    found: list[str] = []
    for f in sorted(package_dir.glob("*.py")):
        if f.name != internals:
            found += scan_file(f, own, f.name, own=package)
    if internals is not None:
        core = core_private_names(core_dir)
        for hit in scan_file(package_dir / internals, own, internals, own=package):
            if set(re.findall(r"\b_\w+", hit.split(": ", 1)[1])) & core:
                found.append(hit)
    return found


class _FrameworkScan(_Scan):
    """The scan, keeping only what touches ``framework``'s private names: an import of a
    private name or module of it, an access through a name its imports bound (``torch._x``,
    ``dist._x``), or a private name among ``names`` (its classes' private attributes, which a
    value of unknown type such as a tensor argument carries: ``t._version``)."""

    def __init__(
        self, own_classes: set[str], consts: dict[str, str], where: str, framework: str, names: set[str]
    ) -> None:
        super().__init__(own_classes, consts, where)
        self.framework = framework
        self.names = names
        self.bound: set[str] = set()  # names its imports bound in this module

    def _of_framework(self, module: str | None) -> bool:
        return (module or "").split(".")[0] == self.framework

    def _keep(self, before: int, keep: bool) -> None:
        if not keep:
            del self.found[before:]

    def visit_Import(self, node: ast.Import) -> None:
        before = len(self.found)
        super().visit_Import(node)
        mine = [a for a in node.names if self._of_framework(a.name)]
        self.bound.update((a.asname or a.name).split(".")[0] for a in mine)
        self._keep(before, bool(mine))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        before = len(self.found)
        super().visit_ImportFrom(node)
        mine = not node.level and self._of_framework(node.module)
        if mine:
            self.bound.update(a.asname or a.name for a in node.names)
        self._keep(before, mine)

    def _check(self, node: ast.AST, obj: ast.expr, name: str) -> None:
        before = len(self.found)
        super()._check(node, obj, name)
        root = obj
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        self._keep(before, name in self.names or (isinstance(root, ast.Name) and root.id in self.bound))


def framework_private_accesses(
    package_dir: Path, framework: str, names: set[str], *, internals: str | None = None, only: str | None = None
) -> list[str]:
    """``file:line: code`` of every use of ``framework``'s private names (see ``_FrameworkScan``;
    ``names``: its classes' private attributes) in the modules of ``package_dir`` and its
    subpackages but ``internals``, or in the module ``only`` alone (paths relative to
    ``package_dir``): the core's check that torch's privates are touched in one module."""
    files = sorted(package_dir.rglob("*.py"))
    own = {n.name for f in files for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)}
    found: list[str] = []
    for f in files:
        where = f.relative_to(package_dir).as_posix()
        if where == internals or (only is not None and where != only):
            continue
        tree = ast.parse(f.read_text(), str(f))
        scan = _FrameworkScan(own, _module_consts(tree), where, framework, names)
        scan.visit(tree)
        found += scan.found
    return found


def _tests_trust(expr: ast.expr) -> bool:
    """Whether ``expr`` tests the value of ``trust_pickle`` (as a condition or an operand)."""
    if isinstance(expr, ast.Name):
        return expr.id == "trust_pickle"
    if isinstance(expr, ast.Compare):
        return any(_tests_trust(e) for e in [expr.left, *expr.comparators])
    if isinstance(expr, ast.BoolOp):
        return any(_tests_trust(e) for e in expr.values)
    if isinstance(expr, ast.UnaryOp):
        return _tests_trust(expr.operand)
    return False


def own_trust_checks(package_dir: Path) -> list[str]:
    """``file:line: code`` of every test of ``trust_pickle`` in the package (a condition, a
    comparison, a ``not``): the core's ``require_trust`` is the one gate; adapters only pass
    the caller's value on (``require_trust(path, trust_pickle=trust_pickle, ...)``)."""
    found = []
    for f in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
                hit = _tests_trust(node.test)
            else:
                hit = isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp)) and _tests_trust(node)
            if hit:
                found.append(f"{f.name}:{getattr(node, 'lineno', 0)}: {ast.unparse(node).splitlines()[0][:100]}")
    return found


def gate_warnings(internals: Any, monkeypatch: Any) -> tuple[list[str], list[str]]:
    """The warnings an adapter's ``warn_if_untested()`` gives inside its tested range (once) and
    outside it (called twice, with ``TESTED_RANGE`` moved to 0.1 to <0.2)."""
    import warnings

    monkeypatch.setattr(internals.GATE, "warned", False)
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        internals.warn_if_untested()
    monkeypatch.setattr(internals.GATE, "tested", ((0, 1), (0, 2)))
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        internals.warn_if_untested()
        internals.warn_if_untested()
    return [str(w.message) for w in inside], [str(w.message) for w in outside]
