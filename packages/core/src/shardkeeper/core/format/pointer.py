"""A pointer file: a small file, left where a framework expects its own checkpoint file
(Lightning's ``last.ckpt``), that names a shardkeeper root and a step.

On disk it is a zip laid out as torch lays out its checkpoints, so ``torch.load`` loads it
(``weights_only=True`` too) and shows what it is instead of failing. Its members, under the
folder ``shardkeeper-pointer/``:

- ``pointer.json`` (first, stored uncompressed: the file's first bytes show it): the document
  shardkeeper reads, ``{"format": "shardkeeper-<framework>-pointer", "version": 1, "root":
  ..., "step": ..., "root_relative": ...}`` (``root_relative``: a local root's path from the
  pointer's folder);
- ``data.pkl``: what ``torch.load`` returns, a dict of plain strings and ints written opcode by
  opcode here (never read by shardkeeper): ``shardkeeper_pointer`` (the message: what the file
  is, where its checkpoint is, how to load it), ``format``, ``root``, ``step``, the adapter's
  own entries (Lightning's version, so that its loader gets to the state dict), and
  ``state_dict``, a dict whose one key is the message, so that
  ``model.load_state_dict(torch.load(p)["state_dict"])`` fails naming it (an unexpected key);
- ``version`` and ``byteorder``: the records torch's reader requires.

Shardkeeper reads ``pointer.json`` only (:func:`pointer_json`): nothing is unpickled. A bare
JSON document, as pointers were written before the zip, is still read. Torch-free.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from collections.abc import Mapping
from typing import Any

from shardkeeper.core.errors import PointerDamagedError

#: A pointer is small; a file larger than this is not one.
MAX_POINTER_BYTES = 1 << 16
FOLDER = "shardkeeper-pointer"
MEMBER = f"{FOLDER}/pointer.json"
POINTER_VERSION = 1
_ZIP_MAGIC = b"PK\x03\x04"
_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same pointer is the same bytes


def pointer_format(framework: str) -> str:
    """``shardkeeper-<framework>-pointer``: the ``format`` of ``framework``'s pointers."""
    return f"shardkeeper-{framework}-pointer"


def is_pointer_format(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("shardkeeper-") and value.endswith("-pointer")


def looks_like_pointer(data: bytes) -> bool:
    """Whether ``data`` (a file's first bytes) starts as a pointer does: a zip whose first
    member is ``pointer.json``, or a bare JSON document (first non-space byte ``{``). A torch
    checkpoint (a zip whose first member is its ``data.pkl``, or a pickle) does not."""
    if data.startswith(_ZIP_MAGIC):
        return _first_member(data) == MEMBER
    return data.lstrip()[:1] == b"{"


def _first_member(data: bytes) -> str | None:
    if len(data) < 30:
        return None
    (n,) = struct.unpack_from("<H", data, 26)
    return data[30 : 30 + n].decode("utf-8", "replace")


def pointer_json(data: bytes) -> bytes:
    """The JSON document of the pointer whose bytes are ``data`` (:func:`looks_like_pointer`
    holds). Raises :class:`PointerDamagedError` saying what is wrong."""
    kind = "a zip" if data.startswith(_ZIP_MAGIC) else "JSON"
    if len(data) > MAX_POINTER_BYTES:
        raise PointerDamagedError(
            f"it starts like one ({kind}) but is larger than a pointer ({MAX_POINTER_BYTES} bytes)"
        )
    if kind == "JSON":
        return data
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return z.read(MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError) as e:
        raise PointerDamagedError(
            f"it starts like one (a zip) but does not read (truncated or overwritten?): {e}"
        ) from None


def pointer_document(data: bytes) -> dict[str, Any]:
    """The parsed JSON document (a dict, its fields unchecked) of the pointer ``data``."""
    raw = pointer_json(data)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise PointerDamagedError(
            f"it starts like one but its JSON does not parse (truncated or overwritten?): {e}"
        ) from None
    if not isinstance(doc, dict):
        raise PointerDamagedError(f"its JSON holds {type(doc).__name__}, not an object")
    return doc


def pointer_message(root: str, step: int, how: str) -> str:
    """What ``torch.load`` of a pointer shows: what the file is, where its checkpoint is,
    and ``how`` to load it (the adapter's words)."""
    return (
        f"This file is a shardkeeper pointer, not a torch checkpoint: its checkpoint is step {step} "
        f"of the shardkeeper root {root}. {how}"
    )


def encode_pointer(doc: Mapping[str, Any], message: str, extra: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of a pointer file holding ``doc`` (its ``format``, ``root`` and ``step``
    included) and, for ``torch.load``, ``message``; ``extra``: more entries of what
    ``torch.load`` returns (strings and ints: an adapter's, so its framework's loader reaches
    ``state_dict`` and its message)."""
    shown = {
        **(extra or {}),
        "shardkeeper_pointer": message,
        "format": doc["format"],
        "root": doc["root"],
        "step": doc["step"],
        "state_dict": {message: "not a tensor: this file is a shardkeeper pointer"},
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in (
            (MEMBER, json.dumps(dict(doc)).encode()),
            (f"{FOLDER}/data.pkl", _pickled(shown)),
            (f"{FOLDER}/byteorder", b"little"),
            (f"{FOLDER}/version", b"3\n"),
        ):
            z.writestr(zipfile.ZipInfo(name, _DATE), data)
    return out.getvalue()


def _pickled(value: Any) -> bytes:
    """``value`` (a dict of str keys and str, int or such dict values; ints below 2**2040) as pickle protocol 2,
    opcode by opcode: only the opcodes ``torch.load(weights_only=True)`` accepts for them."""
    return b"\x80\x02" + _op(value) + b"."


def _op(value: Any) -> bytes:
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    if type(value) is int:
        if -(1 << 31) <= value < 1 << 31:
            return b"J" + struct.pack("<i", value)  # BININT
        raw = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw  # LONG1 (a step past 2**31)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return b"}(" + b"".join(_op(k) + _op(v) for k, v in value.items()) + b"u"  # EMPTY_DICT MARK SETITEMS
    raise TypeError(f"a pointer's torch view holds str, int and dicts of str keys, not {type(value).__name__}")


__all__ = [
    "FOLDER",
    "MAX_POINTER_BYTES",
    "MEMBER",
    "POINTER_VERSION",
    "PointerDamagedError",
    "encode_pointer",
    "is_pointer_format",
    "looks_like_pointer",
    "pointer_document",
    "pointer_format",
    "pointer_json",
    "pointer_message",
]
