"""Integral values as arguments take them: an ``int``, a ``numpy.int64``, anything with
``__index__``, but never a bool (``True`` is an int to Python, not a count or an offset) nor
a float (``int(0.5)`` would truncate it into another value silently). One rule for the
manager's arguments (``config/arguments.py``) and the logical digest's boxes
(``state/logical.py``)."""

from __future__ import annotations

import operator
from typing import Any


def integral(value: Any) -> int | None:
    """``value`` as an int when it is of an integral type (``int``, ``numpy.int64``, anything
    with ``__index__``) other than a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


__all__ = ["integral"]
