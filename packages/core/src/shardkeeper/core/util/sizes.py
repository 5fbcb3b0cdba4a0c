"""Byte counts for people: ``1536`` -> ``1.5 KiB``. One formatter for the CLI, the verifier's
log lines and the library's error messages."""

from __future__ import annotations


def human_size(n: int | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


__all__ = ["human_size"]
