"""A pickle payload that leaves a trace when it is unpickled (all suites).

``Trace(path)`` pickles to a call of ``os.makedirs(path, exist_ok=True)``: unpickling it, as a hostile
checkpoint's code would run, creates the folder ``path`` (and yields ``None``); torch's
restricted ``weights_only`` unpickler refuses it. A test puts one where the loader under test
reads, and checks the folder after each refused import.
"""

from __future__ import annotations

import os
from typing import Any

#: ``trust_pickle`` values that must be refused: only the bool True opts in.
UNTRUSTED: tuple[Any, ...] = (False, "false", "true", 1, "yes", None)


class Trace:
    """Unpickled, creates the folder ``path``: the stand-in for code in a pickle."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.path, 0o777, True))  # exist_ok: a loader may read it twice
