"""The framework versions an adapter's internals were checked on, and one warning outside them.

Each adapter keeps the private framework attributes it needs in one internals module, with
the range of framework versions they were verified on; a :class:`VersionGate` warns once per
framework and version when the installed one lies outside that range (the adapter still runs:
its internals module's contract checks say whether the attributes it needs are there).
"""

from __future__ import annotations

import re
import warnings

Version = tuple[int, ...]


def parse_version(text: str) -> Version:
    """``"0.19.8"`` / ``"2.6.0rc1"`` / ``"5.24.0.dev0"`` -> ``(0, 19, 8)`` / ``(2, 6, 0)`` / ``(5, 24, 0)``."""
    nums = []
    for part in str(text).split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        nums.append(int(m.group()))
    return tuple(nums)


def in_range(version: str, tested: tuple[Version, Version]) -> bool:
    """Whether ``version``'s major.minor lies in ``[low, high)`` (major.minor tuples)."""
    low, high = tested
    v = parse_version(version)[: len(low)]
    return tuple(low) <= v < tuple(high)


def range_text(tested: tuple[Version, Version]) -> str:
    """``((2, 5), (2, 7))`` -> ``"2.5 to <2.7"``."""
    low, high = (".".join(map(str, t)) for t in tested)
    return f"{low} to <{high}"


def untested_warning(package: str, framework: str, version: str, tested: tuple[Version, Version], why: str) -> str:
    """The one wording of "this adapter was not verified with the installed framework"."""
    return f"{package} was verified with {framework} {range_text(tested)}; {version} is outside that range ({why})"


class VersionGate:
    """One adapter's verified release range of its framework, and its one warning outside it
    (once per process). The adapter's internals module makes one and uses it."""

    def __init__(self, package: str, framework: str, module: str, tested: tuple[Version, Version], why: str) -> None:
        self.package, self.framework, self.module, self.tested, self.why = package, framework, module, tested, why
        self.warned = False

    def version(self) -> str:
        import importlib

        return str(importlib.import_module(self.module).__version__)

    def in_range(self) -> bool:
        return in_range(self.version(), self.tested)

    def range_text(self) -> str:
        return range_text(self.tested)

    def warn_if_untested(self, stacklevel: int = 3) -> None:
        """Warn (once per process) when the installed release is outside the tested range."""
        if self.warned or self.in_range():
            return
        self.warned = True
        warnings.warn(
            untested_warning(self.package, self.framework, self.version(), self.tested, self.why), stacklevel=stacklevel
        )


__all__ = ["Version", "VersionGate", "in_range", "parse_version", "range_text", "untested_warning"]
