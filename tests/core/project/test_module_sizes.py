"""Small modules with one job each: no module of the distributions' sources grows past
``LIMIT`` lines. The modules already past it are listed at their size, which may only shrink
(lower an entry when its module shrinks; split a module rather than raise its entry)."""

from __future__ import annotations

from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3] / "packages"
LIMIT = 400
#: Modules over ``LIMIT``, each at most the lines it had when it was listed.
OVER: dict[str, int] = {}


def _sizes() -> dict[str, int]:
    return {
        path.relative_to(PACKAGES).as_posix(): len(path.read_text().splitlines())
        for path in sorted(PACKAGES.glob("*/src/**/*.py"))
    }


def test_no_module_grows_past_its_limit() -> None:
    sizes = _sizes()
    assert sizes, f"no sources found under {PACKAGES}"
    grown = {p: (n, OVER.get(p, LIMIT)) for p, n in sizes.items() if n > OVER.get(p, LIMIT)}
    assert not grown, "modules past their size limit (lines, limit): " + ", ".join(
        f"{p} ({n} > {limit})" for p, (n, limit) in sorted(grown.items())
    )


def test_every_listed_module_exists_and_is_still_over_the_limit() -> None:
    """An entry whose module shrank under ``LIMIT`` or went away is removed, so the list stays true."""
    sizes = _sizes()
    stale = [p for p in OVER if sizes.get(p, 0) <= LIMIT]
    assert not stale, f"remove these entries of OVER (gone or now within {LIMIT} lines): {stale}"
