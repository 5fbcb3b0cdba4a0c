"""How the CLI shows things to a person: sizes, tables, and text made safe for a terminal.

Keys, metadata and values in a manifest, and the error messages that quote them, are written
by whoever wrote the checkpoint. Printed raw, a control character among them (``\\x1b[2J``
clears the screen, ``\\r`` overwrites a line, U+202E reverses what follows) acts on the
reader's terminal. So every line of the CLI's human-readable output goes through ``say``, which
escapes such characters (``printable``), and its log records through ``PrintableFormatter``.
``--json`` output is JSON with ASCII escapes (``json.dumps``), exact and safe as it is.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import IO, Any

from shardkeeper.core.util.sizes import human_size


def printable(text: str) -> str:
    """``text`` with every character that ``str.isprintable`` rejects written as its Python
    escape: control characters (``\\x1b``, ``\\r``, ``\\n``, ``\\x07``, C1 controls), format
    characters (bidi overrides such as ``\\u202e``, zero-width ones), line and paragraph
    separators, non-space blanks, surrogates and unassigned code points. Everything else,
    non-ASCII letters included, stays as it is (and so does ``\\``: the result is for reading)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def say(*lines: object, file: IO[str] | None = None) -> None:
    """Print each of ``lines`` as one line (``printable``: a line break inside one is escaped)."""
    print("\n".join(printable(str(line)) for line in lines), file=sys.stdout if file is None else file)


class PrintableFormatter(logging.Formatter):
    """A formatter whose records are ``printable``: one line each, no control character."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> list[str]:
    """Columns padded to their widest cell (cells ``printable``, so widths hold); ``align`` is
    one ``l``/``r`` per column."""
    cells = [[printable(str(h)) for h in headers]] + [["" if c is None else printable(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return lines


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> str:
    """``table_lines`` joined into one string."""
    return "\n".join(table_lines(headers, rows, align))


def preview(value: Any, width: int = 60) -> str:
    """A JSON value on one line, cut to ``width`` characters."""
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


__all__ = ["PrintableFormatter", "format_table", "human_size", "preview", "printable", "say", "table_lines"]
