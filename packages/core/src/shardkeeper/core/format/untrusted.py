"""JSON read from storage, parsed as untrusted input: every reader of a manifest, a
safetensors header, an encryption header or a record under the root goes through
``loads_untrusted``.

A bucket may be shared or compromised, so a document is refused, with an ``UntrustedJSONError``
(a ``ValueError``) that says why, when it is larger than its reader accepts, is not valid JSON
(bytes that are not UTF-8, ``NaN``, numbers the parser refuses) or is nested deeper than
``MAX_JSON_DEPTH`` levels. Deeper values would exhaust the stack of whatever touches them later
(``str()``, ``json.dumps``, a comparison): the parsers themselves stop at ~1000 levels (orjson
at 1024, the standard library's at the interpreter's recursion limit, both caught here), which
is still too deep for the code after them. Callers turn the error into a
``CorruptCheckpointError`` that names the file and the remedy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from shardkeeper.core.errors import UntrustedJSONError
from shardkeeper.core.format.fastjson import orjson as _orjson
from shardkeeper.core.format.jsonvalue import loads_exact

#: Nesting limit of a document read from storage (the whole document: an object inside the
#: top-level object is at level 2). No document shardkeeper writes comes close.
MAX_JSON_DEPTH = 100


def loads_untrusted(
    data: bytes | str,
    *,
    max_bytes: int,
    max_depth: int = MAX_JSON_DEPTH,
    exact: Callable[[Any], bool] | None = None,
) -> Any:
    """Parse ``data`` (at most ``max_bytes`` long, nested at most ``max_depth`` levels).
    ``exact``: the document may declare extended JSON values, and this says whether a parsed
    one does (a manifest: jsonvalue.py ``loads_exact``)."""
    if len(data) > max_bytes:
        raise UntrustedJSONError(f"is {len(data)} bytes, more than the {max_bytes} a reader accepts")
    try:
        if exact is not None:
            value = loads_exact(data.encode() if isinstance(data, str) else data, exact)
        else:
            value = _orjson.loads(data) if _orjson is not None else json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError, TypeError) as e:  # also UnicodeDecodeError, orjson's depth limit
        raise UntrustedJSONError(f"is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if too_deep(value, max_depth):
        raise UntrustedJSONError(f"is nested deeper than {max_depth} levels")
    return value


def too_deep(value: Any, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Does ``value`` hold arrays or objects nested more than ``max_depth`` levels (a bare
    array is one level)? Walks level by level, without recursion; an array whose elements
    add up as numbers (the long integer columns of a manifest) or join as strings (its keys)
    holds no container, which ``sum`` and ``str.join`` find in C."""
    level = [value] if type(value) in (list, dict) else []
    depth = 0  # the containers in ``level`` are at level depth + 1
    while level:
        if depth == max_depth:
            return True
        below: list[Any] = []
        for v in level:
            items = list(v.values()) if type(v) is dict else v
            try:
                sum(items)
                continue  # numbers only (containers and strings raise TypeError)
            except (TypeError, OverflowError):  # OverflowError: a float beside a huge integer
                pass
            if strings_only(items):
                continue  # (a manifest's or an index file's keys)
            below.extend([x for x in items if type(x) is list or type(x) is dict])
        level = below
        depth += 1
    return False


def strings_only(items: Any) -> bool:
    """Is every element of the list ``items`` a ``str``? Checked in C (``str.join`` refuses
    anything else): the key columns of a manifest or an index file hold 100,000s."""
    try:
        "".join(items)
    except TypeError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# UntrustedJSONError: defined in errors; re-exported for the modules that still import it from here
__all__ = ["MAX_JSON_DEPTH", "UntrustedJSONError", "loads_untrusted", "strings_only", "too_deep"]
