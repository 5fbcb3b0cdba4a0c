"""Progress bars and notices for long work, on stderr only: the one place that makes bars.

Bars are tqdm's. They show when stderr is a terminal, or when forced (``--progress``), and
never otherwise: piped or logged stderr stays clean, and stdout (results, ``--json``) is never
written. ``--no-progress``, ``--json`` and ``--quiet`` hide them (``--progress`` still forces
one with ``--json``: it goes to stderr). The library functions that do long work
(``export_safetensors``, ``import_dcp``, ``verify_root``, ``collect_garbage``) make their bar
here too when asked (``progress=True``), so the Python API and the CLI show the same bar.

It sits at the bottom layer of the core (it imports only tqdm), so the library and the CLI share it.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

from tqdm import tqdm


def want_progress(forced: bool | None, *, json: bool = False, quiet: bool = False) -> bool:
    """Whether to show bars: ``forced`` (``--progress`` True, ``--no-progress`` False) wins;
    otherwise only when stderr is a terminal and neither ``--json`` nor ``--quiet`` is set."""
    if forced is not None:
        return forced
    if json or quiet:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def make_bar(total: int | None, desc: str, enabled: bool | None = None, *, unit: str = "B", leave: bool = True) -> Any:
    """A tqdm bar of ``total`` ``unit`` on stderr (bytes scaled as KiB/MiB/GiB), or a disabled
    one (``update``/``close`` do nothing) unless ``enabled`` (None: stderr is a terminal).
    ``leave=False`` erases it when closed (for a bar that precedes the command's output)."""
    on = want_progress(enabled)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        disable=not on,
        dynamic_ncols=True,
        leave=leave,
    )


class BarSafeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log handler whose lines do not tear a bar being drawn (``tqdm.write`` clears it,
    writes the line, and redraws it)."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


__all__ = ["BarSafeHandler", "make_bar", "want_progress"]
