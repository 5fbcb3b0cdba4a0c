"""Restorable patches of framework objects: every adapter can be detached.

An adapter that takes over a framework method (an engine's ``save_checkpoint``, an
Accelerator's ``save_state``, a Lightning ``Strategy`` property) records it in a
:class:`Patches`; ``restore()`` puts back exactly what was there, newest first: an attribute
of the instance itself, or nothing (so the class's own method shows through again).
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class Patches:
    """A stack of attribute replacements on objects or classes, undone by :meth:`restore`."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        """``setattr(target, name, value)``, remembering what ``target`` itself held (its
        ``__dict__`` entry: a class attribute of an instance is not copied onto it)."""
        own = vars(target).get(name, _MISSING) if hasattr(target, "__dict__") else getattr(target, name, _MISSING)
        self._undo.append((target, name, own))
        setattr(target, name, value)

    def patched(self, target: Any, name: str) -> bool:
        """Whether ``name`` of ``target`` is replaced by this stack."""
        return any(t is target and n == name for t, n, _ in self._undo)

    def restore(self) -> None:
        """Undo every replacement, newest first (idempotent)."""
        while self._undo:
            target, name, own = self._undo.pop()
            if own is _MISSING:
                try:
                    delattr(target, name)
                except AttributeError:
                    pass
            else:
                setattr(target, name, own)

    def __bool__(self) -> bool:
        return bool(self._undo)


__all__ = ["Patches"]
