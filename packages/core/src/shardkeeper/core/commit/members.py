"""The members of a record read from the c10d store, checked for their kinds; the error for a
message that is not a record (``commit/protocol.py``). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkeeper.core.errors import ProtocolError


def malformed(where: str, problem: str) -> ProtocolError:
    """The error for a message at ``where`` (the step, the rank, the store key) that is not a record."""
    return ProtocolError(
        f"{where}: {problem}; every rank must run the same shardkeeper version, and nothing else "
        f"may write under the manager's store keys. The checkpoint was not committed"
    )


def as_object(doc: object, where: str) -> Mapping[str, Any]:
    """``doc`` as a JSON object, or the error for a message that is not one."""
    if not isinstance(doc, dict):
        raise malformed(where, f"it is a JSON {type(doc).__name__}, not an object")
    return doc


_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bool": (bool,),
    "number": (int, float),
    "object": (dict,),
    "list": (list,),
}
_NAMES = {
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "number": "a number",
    "object": "an object",
    "list": "a list",
    "list[int]": "a list of integers",
    "list[str]": "a list of strings",
}


#: kind -> (the types of the value, the exact types of its items for a list kind or None,
#: whether bool is one)
_SPECS: dict[str, tuple[tuple[type, ...], frozenset[type] | None, bool]] = {
    k: (_KINDS[k.partition("[")[0]], frozenset(_KINDS[k.partition("[")[2][:-1]]) if "[" in k else None, k == "bool")
    for k in _NAMES
}


def member(doc: Mapping[str, Any], name: str, kind: str, where: str) -> Any:
    """Member ``name`` of ``doc``, of ``kind`` (``list[str]``, ``list[int]``: a list of those).
    (The coordinator checks every member of 16,384 reports: no string work per call, and a
    list's items checked by their exact types in one pass in C; a JSON parser makes no
    subclasses, and ``bool`` is not ``int`` there.)"""
    try:
        value = doc[name]
    except KeyError:
        raise malformed(where, f"member {name!r} is missing") from None
    outer, inner, is_bool = _SPECS[kind]
    ok = isinstance(value, outer) and (is_bool or value.__class__ is not bool)
    if ok and inner is not None and value:
        ok = set(map(type, value)) <= inner
    if not ok:
        raise malformed(where, f"member {name!r} is {describe_value(value)}, not {_NAMES[kind]}")
    return value


def describe_value(value: object) -> str:
    """A value as an error names it: its type and the start of its repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


__all__ = ["as_object", "describe_value", "malformed", "member"]
