"""Short functions with one job each: no function or method of the distributions' sources runs
past ``LIMIT`` lines (from its ``def`` to its last line, docstring included). The functions
already past it are listed at their length, which may only shrink (lower an entry when its
function shrinks; split a function rather than raise its entry)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3] / "packages"
LIMIT = 80
#: Functions over ``LIMIT`` (``path:qualified.name``), each at most the lines it had when listed.
OVER: dict[str, int] = {}


def _lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Each function's and method's length by its dotted name (nested ones under their parents)."""
    out: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                out[name] = (node.end_lineno or node.lineno) - node.lineno + 1
            out.update(_lengths(node, name + "."))
        else:
            out.update(_lengths(node, prefix))
    return out


def _sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        where = path.relative_to(PACKAGES).as_posix()
        lengths = _lengths(ast.parse(path.read_text(), str(path)))
        out.update({f"{where}:{name}": n for name, n in lengths.items()})
    return out


def test_no_function_grows_past_its_limit() -> None:
    sizes = _sizes()
    assert sizes, f"no functions found under {PACKAGES}"
    grown = {f: (n, OVER.get(f, LIMIT)) for f, n in sizes.items() if n > OVER.get(f, LIMIT)}
    assert not grown, "functions past their length limit (lines, limit); split them into helpers: " + ", ".join(
        f"{f} ({n} > {limit})" for f, (n, limit) in sorted(grown.items())
    )


def test_every_listed_function_exists_and_is_still_over_the_limit() -> None:
    """An entry whose function shrank under ``LIMIT`` or went away is removed, so the list stays true."""
    sizes = _sizes()
    stale = [f for f in OVER if sizes.get(f, 0) <= LIMIT]
    assert not stale, f"remove these entries of OVER (gone or now within {LIMIT} lines): {stale}"


def test_the_lengths_count_from_def_to_the_last_line() -> None:
    """The measure sees methods and nested functions, and counts a docstring and the signature."""
    tree = ast.parse(
        "class A:\n"
        "    def m(self):\n"
        '        """Doc."""\n'
        "        def inner():\n"
        "            return 1\n"
        "        return inner()\n"
        "def f(\n"
        "    x,\n"
        "):\n"
        "    return x\n"
    )
    assert _lengths(tree) == {"A.m": 5, "A.m.inner": 2, "f": 4}
