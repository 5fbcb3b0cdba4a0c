"""The one parser of a pointer file's bytes: every field checked with its exact type.

A pointer (``last.ckpt``, ``epoch=0-step=10.ckpt``) is the core's pointer file
(:mod:`shardkeeper.core.format.pointer`: a small zip ``torch.load`` shows as a message naming
the root and step) holding the JSON document ``{"format": "shardkeeper-lightning-pointer",
"version": 1, "root": ..., "step": ..., "root_relative": ...}``; a bare JSON document (the
earlier form) is read too. Every reader (the plugin's restore, ``fit(ckpt_path=pointer)``,
``load_checkpoint`` and the hooked ``load_from_checkpoint``) goes through :func:`parse_pointer`,
so a damaged or altered pointer fails the same way everywhere: one error naming the pointer,
the field, what was found and the remedy (resume from the root itself). Nothing is coerced
(``"16"``, ``16.0``, ``true`` are not steps), and a file that starts like a pointer but is not
one is refused here rather than handed to ``torch.load``.
"""

from __future__ import annotations

from typing import Any

from shardkeeper.core.adapter import (
    MAX_POINTER_BYTES,
    POINTER_VERSION,
    PointerDamagedError,
    pointer_document,
    pointer_format,
)
from shardkeeper.core.errors import CorruptCheckpointError, IncompatibleFormatError

POINTER_FORMAT = pointer_format("lightning")
KNOWN_VERSIONS = frozenset({POINTER_VERSION})
_MISSING = object()
_FOUND_CHARS = 48


def found(value: Any) -> str:
    """What was found, for an error: the type's name and a repr cut to a bounded length."""
    if value is _MISSING:
        return "nothing (the field is missing)"
    r = repr(value)
    if len(r) > _FOUND_CHARS:
        r = r[: _FOUND_CHARS - 3] + "..."
    return f"{type(value).__name__} {r}"


def _remedy(root: Any) -> str:
    where = repr(root) if isinstance(root, str) and root.strip() and not _http(root) else "'<root>'"
    return (
        f"Resume from the checkpoint root itself (the directory or URL holding step-XXXXXXXXXXXX "
        f"directories): trainer.fit(..., ckpt_path={where}) or shardkeeper.lightning.load_checkpoint({where}); "
        f"torch.load of this file gives only a message naming its root and step"
    )


def _damaged(path: str, what: str, root: Any = _MISSING) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"shardkeeper pointer {path} is damaged: {what}. {_remedy(root)}")


def _http(root: str) -> bool:
    return root.lower().startswith(("http://", "https://"))


def parse_pointer(path: str, data: bytes) -> dict[str, Any]:
    """The checked fields of the pointer ``path`` whose bytes (or first bytes) are ``data``:
    ``root`` (a non-empty string), ``step`` (an int >= 0), ``root_relative`` (a string, when
    present). Unknown extra fields are ignored. Raises :class:`CorruptCheckpointError` for a
    damaged pointer and :class:`IncompatibleFormatError` for one of a newer format."""
    try:
        doc = pointer_document(data)
    except PointerDamagedError as e:
        raise _damaged(path, str(e)) from None
    fmt = doc.get("format", _MISSING)
    if fmt != POINTER_FORMAT:
        raise _damaged(path, f"field 'format' must be {POINTER_FORMAT!r}, found {found(fmt)} (not a pointer file?)")
    root = doc.get("root", _MISSING)
    version = doc.get("version", _MISSING)
    if type(version) is int and version > max(KNOWN_VERSIONS):
        raise IncompatibleFormatError(
            f"shardkeeper pointer {path} has version {version}: written by a newer shardkeeper "
            f"(this one reads versions {sorted(KNOWN_VERSIONS)}): upgrade shardkeeper-lightning. {_remedy(root)}"
        )
    if type(version) is not int or version not in KNOWN_VERSIONS:
        raise _damaged(
            path, f"field 'version' must be an int in {sorted(KNOWN_VERSIONS)}, found {found(version)}", root
        )
    if not isinstance(root, str) or not root.strip():
        raise _damaged(path, f"field 'root' must be a non-empty string, found {found(root)}")
    if _http(root):
        raise _damaged(
            path,
            f"field 'root' is an http(s) URL ({found(root)}): shardkeeper roots live on a local disk or an "
            f"object store (s3://, gs://, ...), HTTP is not a storage the core writes or reliably reads "
            f"(no ranged reads or listings guaranteed); copy the root to one and load it from there",
        )
    step = doc.get("step", _MISSING)
    if type(step) is not int or step < 0:
        raise _damaged(path, f"field 'step' must be an int >= 0, found {found(step)}", root)
    rel = doc.get("root_relative", _MISSING)
    if rel is not _MISSING and not isinstance(rel, str):
        raise _damaged(path, f"field 'root_relative' must be a string when present, found {found(rel)}", root)
    out: dict[str, Any] = {"root": root, "step": step}
    if rel is not _MISSING:
        out["root_relative"] = rel
    return out


__all__ = ["KNOWN_VERSIONS", "MAX_POINTER_BYTES", "POINTER_FORMAT", "POINTER_VERSION", "found", "parse_pointer"]
