"""Checks of the arguments of ``CheckpointManager``'s public methods, before any work.

A swapped or mistyped argument (``restore(2, state)``, ``save(state, 3)``) would otherwise
fail deep inside with a message about a comparison or a dump of a model's repr. These name
the argument, the type that was passed (never a repr of a model) and the right call form.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: How each method is called, for the messages.
CALL_FORMS = {
    "save": "mgr.save(step, state)",
    "restore": "mgr.restore(state, step=None)",
    "load": "mgr.load(step=None, only=None)",
    "delete": "mgr.delete(step)",
    "manifest": "mgr.manifest(step=None)",
    "is_committed": "mgr.is_committed(step)",
    "step_url": "mgr.step_url(step)",
}


def _kind(value: Any) -> str:
    """``int 3`` for a number, the type's name for anything else (a model's repr is huge)."""
    if isinstance(value, (bool, int, float)) or value is None:
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def check_step(method: str, step: Any, *, optional: bool = False) -> None:
    """``step`` is a non-negative int (not a bool); None too when ``optional``."""
    if step is None and optional:
        return
    form = CALL_FORMS[method]
    if isinstance(step, Mapping):
        raise TypeError(f"{method}(): step must be an int, got a {type(step).__name__} (the state?); call it as {form}")
    if not isinstance(step, int) or isinstance(step, bool):
        accepted = "an int >= 0 or None" if optional else "an int >= 0"
        raise TypeError(f"{method}(): step must be {accepted}, got {_kind(step)}; call it as {form}")
    if step < 0:
        raise ValueError(f"{method}(): step must be >= 0, got {step}; call it as {form}")


def check_state(method: str, state: Any) -> None:
    """``state`` is a mapping of names to values (a swapped step and state say so)."""
    if isinstance(state, Mapping):
        return
    form = CALL_FORMS[method]
    swapped = isinstance(state, int) and not isinstance(state, bool)
    hint = " (the step? the state comes " + ("second" if method == "save" else "first") + ")" if swapped else ""
    example = "{'model': model, 'optim': optimizer}"
    raise TypeError(
        f"{method}(): state must be a mapping of names to values such as {example}, got "
        f"{_kind(state)}{hint}; call it as {form}"
    )


__all__ = ["CALL_FORMS", "check_state", "check_step"]
