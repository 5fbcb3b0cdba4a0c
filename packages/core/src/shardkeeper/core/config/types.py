"""The declared types of settings, checked and converted: ``conform`` (a value, or text read
from an environment variable or a file, as of a type: ``int``, ``float``, ``bool``, ``str``,
``Literal`` choices, fixed tuples, mappings, unions with None) and the errors that name what an
option takes. ``CheckpointOptions`` (``options.py``) and the settings readers
(``settings.py``) use it. Torch-free.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from shardkeeper.core.errors import Mismatch


def type_name(hint: Any) -> str:
    """How an error names a type: ``int``, ``one of blocking, overlap``, ``str or KeyProvider``."""
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(hint))
    if _is_union(hint):
        return " or ".join(type_name(a) for a in get_args(hint) if a is not type(None))
    if get_origin(hint) in (dict, Mapping) or hint in (dict, Mapping):
        return "mapping"
    if get_origin(hint) is tuple:
        return "(" + ", ".join(type_name(a) for a in get_args(hint)) + ")"
    return "value" if hint is Any else getattr(hint, "__name__", str(hint))


def _not_choices(hint: Any) -> bool:
    return get_origin(hint) is not Literal


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def conform(value: Any, hint: Any, *, from_text: bool = False) -> Any:
    """``value`` as of type ``hint`` (an int for a float field becomes a float), or ``Mismatch``.

    ``from_text``: text (and YAML's 0/1 for a bool) converts to the type, as settings read
    from an environment variable or a file do; otherwise only the type itself is accepted.
    """
    if hint is Any:
        return value
    if _is_union(hint):
        if value is None and type(None) in get_args(hint):
            return None
        arms = [a for a in get_args(hint) if a is not type(None)]
        misses = []
        for arm in sorted(arms, key=_not_choices):  # choices first
            try:
                return conform(value, arm, from_text=from_text)
            except Mismatch as e:
                misses.append(e)
        kind = ValueError if any(e.kind is ValueError for e in misses) else TypeError
        raise Mismatch("; ".join(str(e) for e in misses), kind)
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        text = value.strip() if from_text and isinstance(value, str) else value
        if any(text == c and type(text) is type(c) for c in choices):
            return text
        raise Mismatch("not among the choices", ValueError if isinstance(value, str) else TypeError)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and (isinstance(value, str) or (isinstance(value, int) and value in (0, 1))):
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        raise Mismatch("expected true/false")
    if hint in (int, float):
        if isinstance(value, int) and not isinstance(value, bool):
            return hint(value)
        if hint is float and isinstance(value, float):
            return value
        if from_text and isinstance(value, str):
            try:
                return hint(value.strip())
            except ValueError:
                pass
        raise Mismatch("expected an integer" if hint is int else "expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise Mismatch("expected text")
    if get_origin(hint) is tuple:
        return _conform_tuple(value, get_args(hint), from_text)
    if get_origin(hint) in (dict, Mapping) or hint in (dict, Mapping):
        if from_text and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise Mismatch(f"not JSON: {e}") from None
        if isinstance(value, Mapping):
            return dict(value)
        raise Mismatch("expected a mapping (JSON object)")
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise Mismatch(f"expected a {hint.__name__}")
    raise TypeError(f"no rule to check a value against the type {hint!r}")


def _conform_tuple(value: Any, hints: tuple[Any, ...], from_text: bool) -> tuple[Any, ...]:
    """A fixed tuple from a tuple or list (YAML, JSON), or from text: a JSON list or the values
    separated by commas (``3,val_loss,min``)."""
    if from_text and isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",")]
        except ValueError as e:
            raise Mismatch(f"not a JSON list: {e}") from None
    if not isinstance(value, (tuple, list)) or len(value) != len(hints):
        raise Mismatch(f"expected {len(hints)} values ({', '.join(type_name(h) for h in hints)})")
    return tuple(conform(v, h, from_text=from_text) for v, h in zip(value, hints))


def check_value(name: str, value: Any, hint: Any) -> Any:
    """``conform`` for a ``CheckpointOptions`` field: a ``TypeError`` (wrong kind of value) or
    ``ValueError`` (not among the choices) that names the option, the value and what it takes."""
    try:
        return conform(value, hint)
    except Mismatch as e:
        if e.kind is ValueError:
            raise ValueError(f"{name}={value!r}; choose {_takes(hint)}") from None
        raise TypeError(f"{name}={value!r} is of type {type(value).__name__}; {name} takes {_takes(hint)}") from None


def _takes(hint: Any) -> str:
    """What a field takes, for an error: ``one of blocking, overlap``; ``one of zstd, none,
    None``; ``an int``; ``a str or None``."""
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(hint))
    if _is_union(hint):
        arms = [a for a in get_args(hint) if a is not type(None)]
        if get_origin(arms[0]) is Literal:
            return ", ".join([_takes(a) for a in arms] + (["None"] if type(None) in get_args(hint) else []))
        quoted = [", ".join(repr(c) for c in get_args(a)) if get_origin(a) is Literal else _takes(a) for a in arms]
        return " or ".join(quoted + (["None"] if type(None) in get_args(hint) else []))
    if hint is bool:
        return "True or False"
    if get_origin(hint) is tuple:
        return f"a tuple {type_name(hint)}"
    return {int: "an int", float: "a number", str: "a str"}.get(hint, f"a {type_name(hint)}")


__all__ = ["Mismatch", "check_value", "conform", "type_name"]
