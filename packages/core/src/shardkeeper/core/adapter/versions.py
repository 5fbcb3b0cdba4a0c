"""The framework versions an adapter's internals were checked on, and one warning outside them.

Each adapter keeps the private framework attributes it needs in one internals module, with
the range of framework versions they were verified on; :func:`check_tested` warns once per
framework and version when the installed one lies outside that range (the adapter still runs:
its internals module's contract checks say whether the attributes it needs are there).
"""

from __future__ import annotations

import re
import warnings

_warned: set[tuple[str, str]] = set()

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


def check_tested(framework: str, version: str, tested: tuple[Version, Version], *, stacklevel: int = 3) -> bool:
    """True if ``version`` of ``framework`` is in ``tested``; else warn (once) and return False."""
    if in_range(version, tested):
        return True
    key = (framework, str(version))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(untested_warning(f"shardkeeper's {framework} adapter", framework, version, tested,
                                       "its internals checks decide whether it works"), stacklevel=stacklevel)
    return False


__all__ = ["Version", "check_tested", "in_range", "parse_version", "range_text", "untested_warning"]
