"""JSON values that come back exactly.

Object leaves and metadata are stored as JSON in the manifest (and travel as JSON in the
ranks' reports). A value is accepted at save time only if it will be read back equal, with
the same types:

- strings and dict keys must be valid Unicode: a lone surrogate (``os.fsdecode`` of a
  non-UTF-8 file name, ``sys.argv``, ``os.environ``) has no UTF-8 form, so it is refused,
  naming the key; dict keys must be strings (JSON would turn ``1`` into ``"1"``);
- integers of up to 4300 digits (what every Python reads by default) and non-finite floats (``float("inf")`` as a best loss, numpy's PCG64
  state of 128-bit integers) are kept exactly. Standard JSON has no NaN or infinity, and fast
  parsers (orjson) read integers beyond 64 bits as floats. A document holding such a value
  is written by the standard library (``NaN``, ``Infinity``, ``-Infinity`` tokens; integers
  digit for digit) and says so: a manifest by requiring ``"extended-json"``
  (format/features.py), a rank's report by the member ``"extended_json": true``; readers of
  such a document use a parser that keeps them (``loads_exact``).

Depth is bounded by ``MAX_VALUE_DEPTH``: readers refuse documents nested deeper than
``untrusted.MAX_JSON_DEPTH`` levels, and a value sits a few levels down in the manifest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from shardkeeper.core.errors import JsonValueError, StateMismatchError
from shardkeeper.core.format.fastjson import orjson

#: The top-level member that marks a rank's report holding NaN/infinities or integers beyond
#: 64 bits (a manifest requires ``features.EXTENDED_JSON`` instead).
EXTENDED_MEMBER = "extended_json"
#: Nesting limit of one JSON value (an object leaf's, a metadata entry's): readers refuse a
#: document nested more than 100 levels, and an object leaf's value starts at level 4 of the
#: manifest (top level, "leaves", the leaf record, "value"), so this leaves a margin.
MAX_VALUE_DEPTH = 90
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what every JSON reader reads as an integer
#: Python converts integers of at most this many digits to and from text unless a process
#: raises its limit (sys.set_int_max_str_digits): bigger ones could not be read elsewhere.
_MAX_INT_DIGITS = 4300
_MAX_INT_BITS = int(_MAX_INT_DIGITS * 3.3219)  # log2(10): below 10**4300


def _surrogate(s: str) -> str | None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"the string {s[max(0, e.start - 20) : e.end + 20]!r} holds a lone surrogate "
            f"({s[e.start]!r} at position {e.start}), which has no UTF-8 form"
        )
    return None


def check_value(value: Any) -> bool:
    """Check that ``value`` is a JSON value that comes back exactly; return whether it needs the
    extended form (a non-finite float or an integer beyond 64 bits). Raises ``JsonValueError``."""
    extended = False
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, v, depth = stack.pop()
        t = type(v)
        if t is str or isinstance(v, str):
            why = _surrogate(v)
            if why:
                raise JsonValueError(path, why)
        elif v is None or t is bool:
            pass
        elif isinstance(v, int):
            if not _INT_MIN <= v <= _INT_MAX:
                if v.bit_length() > _MAX_INT_BITS:
                    raise JsonValueError(
                        path,
                        f"an integer of {v.bit_length()} bits: readers parse integers of "
                        f"at most {_MAX_INT_DIGITS} digits (Python's default limit)",
                    )
                extended = True
        elif isinstance(v, float):
            if not math.isfinite(v):
                extended = True
        elif isinstance(v, (dict, list, tuple)):
            if depth >= MAX_VALUE_DEPTH:
                raise JsonValueError(path, f"nested deeper than {MAX_VALUE_DEPTH} levels")
            if isinstance(v, dict):
                for k, x in v.items():
                    if type(k) is not str:
                        raise JsonValueError(
                            path,
                            f"dict key {k!r} is a {type(k).__name__}; JSON keys are strings "
                            f"(it would come back as {str(k)!r}): use string keys",
                        )
                    why = _surrogate(k)
                    if why:
                        raise JsonValueError(path, f"dict key: {why}")
                    stack.append((f"{path}/{k}" if path else k, x, depth + 1))
            else:
                stack.extend((f"{path}/{i}" if path else str(i), x, depth + 1) for i, x in enumerate(v))
        else:
            raise JsonValueError(path, f"a {type(v).__name__} is not a JSON value")
    return extended


def describe_problem(key: str, e: JsonValueError) -> str:
    """The message for a state or metadata value that does not come back exactly."""
    where = f"{key}/{e.path}" if e.path else key
    if "surrogate" in e.why:
        hint = "store it as bytes (os.fsencode(s)) or escape it (s.encode('utf-8', 'surrogateescape').hex())"
    elif "an integer of" in e.why:
        hint = "store it as a string (str(n)) and convert it back after the restore"
    else:
        hint = "convert it to a JSON value"
    return f"{where!r}: {e.why}; it would not come back exactly from the checkpoint: {hint}"


def snapshot(values: Mapping[str, Any], what: str) -> tuple[dict[str, Any], bool]:
    """A copy, by value, of ``values`` (key -> JSON value), checked to come back exactly, and
    whether it needs the extended form. Raises ``StateMismatchError`` naming the key
    (``what``: "state key", "metadata key")."""
    extended = False
    for key, value in values.items():
        try:
            if not isinstance(key, str):
                raise JsonValueError("", f"the key {key!r} is a {type(key).__name__}; keys are strings")
            why = _surrogate(key)
            if why:
                raise JsonValueError("", f"the key: {why}")
            extended |= check_value(value)
        except JsonValueError as e:
            raise StateMismatchError(f"{what} {describe_problem(key, e)}") from None
    return json.loads(json.dumps(dict(values), allow_nan=True)), extended


def declares_member(d: Any) -> bool:
    """Whether a parsed report declares extended values (``EXTENDED_MEMBER`` is true)."""
    return isinstance(d, dict) and d.get(EXTENDED_MEMBER) is True


def loads_exact(data: bytes, declares: Callable[[Any], bool] = declares_member) -> Any:
    """Parse a document that may declare extended values (``declares`` says whether a parsed
    one does): the fast parser, unless the document declares them (then the standard
    library's, which keeps integers exact and reads NaN/Infinity). A document that uses them
    without declaring them is refused (``ValueError``), as is one whose strings hold lone
    surrogates."""
    if orjson is not None:
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            fast_error: Exception | None = e
        else:
            if not declares(d):
                return d
            fast_error = None
    else:
        fast_error = None
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name.replace("Infinity", "inf"))

    d = json.loads(data, parse_constant=constant)
    if not declares(d):
        if fast_error is not None:
            raise fast_error
        if constants:
            raise ValueError(f"{constants[0]} in a document that does not declare extended values")
        return d
    _no_lone_surrogates(d)
    return d


def _no_lone_surrogates(d: Any) -> None:
    stack = [d]
    while stack:
        v = stack.pop()
        if type(v) is str:
            if _surrogate(v):
                raise ValueError("a string holds a lone surrogate")
        elif isinstance(v, dict):
            for k, x in v.items():
                if _surrogate(k):
                    raise ValueError("a key holds a lone surrogate")
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)


def dumps_extended(doc: Any) -> bytes:
    """``doc`` (which declares extended values) as the standard library writes it: integers digit
    for digit, NaN/Infinity as tokens."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def same_value(a: Any, b: Any) -> str | None:
    """Where ``a`` (what was written) and ``b`` (what a reader read) differ, by value and type
    (``1`` and ``1.0`` differ, NaN equals NaN; tuples are lists), or None."""
    stack: list[tuple[str, Any, Any]] = [("", a, b)]
    while stack:
        path, x, y = stack.pop()
        if _kind(x) != _kind(y):
            return f"{path or '(the value)'}: wrote {_short(x)}, read {_short(y)}"
        if isinstance(x, dict):
            if x.keys() != y.keys():
                return f"{path or '(the value)'}: keys differ"
            stack.extend((f"{path}/{k}" if path else k, x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return f"{path or '(the value)'}: {len(x)} items written, {len(y)} read"
            stack.extend((f"{path}/{i}" if path else str(i), p, q) for i, (p, q) in enumerate(zip(x, y)))
        elif isinstance(x, float) and math.isnan(x):
            if not math.isnan(y):
                return f"{path or '(the value)'}: wrote nan, read {y!r}"
        elif x != y:
            return f"{path or '(the value)'}: wrote {_short(x)}, read {_short(y)}"
    return None


def _kind(v: Any) -> str:
    """A JSON value's type (subclasses of int, str... are written as their base)."""
    if v is None:
        return "null"
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (dict, "dict")):
        if isinstance(v, t):
            return name
    return "list" if isinstance(v, (list, tuple)) else type(v).__name__


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "EXTENDED_MEMBER",
    "MAX_VALUE_DEPTH",
    "JsonValueError",  # defined in errors; re-exported for the modules that still import it from here
    "check_value",
    "declares_member",
    "describe_problem",
    "dumps_extended",
    "loads_exact",
    "same_value",
    "snapshot",
]
