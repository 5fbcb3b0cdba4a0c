"""The stored form of encrypted data files, and what can be checked of it without a key.

Stored data file: ``SKCRYPT1`` | u32 LE header length | header JSON (``alg``, ``block``,
``key_id``, ``wrapped``, ``root``) | blocks, each ciphertext + 16-byte tag; every block holds
``block`` plaintext bytes except the last (0 .. block). Block ``i`` is sealed with nonce
``block_nonce(i)`` and associated data ``block_aad``. See docs/format.md, section 4.2.

Layering: the bottom of the encryption modules: constants, names and sizes, which need no
key and no cipher. ``EncryptedStorage`` (codec/crypto.py) reads and writes this form;
``verify`` checks it without a key (``keyless_problems``); the manager asks whether a step's
files look encrypted (``files_look_encrypted``) without importing the cipher's storage.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import DATA_DIR, parse_step_dir
from shardkeeper.core.format.untrusted import loads_untrusted
from shardkeeper.core.storage.base import Storage

MAGIC = b"SKCRYPT1"
ALGORITHM = "AES-256-GCM"
BLOCK = 64 << 10
TAG = 16
MAX_HEADER = 64 << 10
_AAD_PREFIX = b"shardkeeper/aes-256-gcm/v2\0"
_SCHEMES = {"gcs": "gs", "s3a": "s3"}


def is_data_path(path: str) -> bool:
    """A file under a step's ``data/``, at any depth (``data/<hex>/...``: hashed prefixes)."""
    parts = path.split("/")
    return any(parts[i + 1] == DATA_DIR and parse_step_dir(parts[i]) is not None for i in range(len(parts) - 2))


def is_manifest_path(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and parts[1] == "manifest.json" and parse_step_dir(parts[0]) is not None


def block_nonce(i: int) -> bytes:
    return struct.pack(">4xQ", i)


def block_aad(path: str, i: int, final: bool, root: str) -> bytes:
    """A block's associated data: its file's root (the binding), root-relative path, index and
    last-block flag."""
    r = root.encode("utf-8", "surrogateescape")
    return _AAD_PREFIX + struct.pack(">I", len(r)) + r + path.encode() + struct.pack(">xQ?", i, final)


def root_identity(url: str) -> str:
    """What encrypted files and manifests are bound to by default: the root's real path on
    local disk (the same through any symlink to it), its normalized URL on an object store."""
    if "://" not in url or url.startswith("file://"):
        return os.path.realpath(url[len("file://") :] if url.startswith("file://") else url)
    scheme, rest = url.split("://", 1)
    return f"{_SCHEMES.get(scheme, scheme)}://{rest.rstrip('/')}"


def bound_name(name: str) -> str:
    """A root name as bindings compare it: an explicit ``encryption_root`` or a recorded one,
    without trailing ``/`` (``"/data/run/"`` and ``"/data/run"`` name one root)."""
    return name.rstrip("/") or name[:1]  # ("//" and "/" name one root too)


def stored_size(plain: int, header: int) -> int:
    n = max(1, -(-plain // BLOCK))
    return header + plain + n * TAG


def files_look_encrypted(storage: Storage, step: int, m: Any) -> bool:
    """Whether the first data file a manifest of ``step`` lists starts as an encrypted file
    does (no key needed): a manifest that claims encryption over plain files was edited."""
    from shardkeeper.core.commit.files import resolve_file

    for rel in sorted(m.files):
        path = resolve_file(step, rel)
        if path is None or not is_data_path(path):  # (pages are not encrypted)
            continue
        try:
            return storage.read_range(path, 0, len(MAGIC)) == MAGIC
        except CheckpointError:
            return True  # unreadable: not evidence of an edit; the key error stands
    return True


def read_header(storage: Storage, path: str) -> tuple[int, dict[str, Any]]:
    """An encrypted file's header length and fields, without any key (for verify)."""
    head = storage.read_range(path, 0, 12)
    if len(head) < 12 or head[:8] != MAGIC:
        raise ValueError(f"no {MAGIC.decode()} header: not an encrypted shardkeeper file")
    (n,) = struct.unpack("<I", head[8:12])
    if n > MAX_HEADER:
        raise ValueError(f"encryption header of {n} bytes")
    h = loads_untrusted(storage.read_range(path, 12, n), max_bytes=MAX_HEADER)
    if not isinstance(h, dict) or h.get("alg") != ALGORITHM or h.get("block") != BLOCK:
        raise ValueError(f"unknown encryption header {str(h)[:120]}")
    return 12 + n, h


def keyless_problems(storage: Storage, m: Any, step: int) -> tuple[int, list[tuple[str, str, str]]]:
    """What ``verify`` checks of an encrypted step without the key: every file the manifest
    names (its own and referenced ones) exists, has an intact encryption header and exactly
    the stored size its plaintext size implies, and holds every chunk's byte range. Digests
    and tags need the key. Returns (files checked, [(kind, message, path)])."""
    from shardkeeper.core.commit.files import resolve_file
    from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError

    ends: dict[str, int] = {}
    problems: list[tuple[str, str, str]] = []

    # Pages (format.md 3.9) are not encrypted (the manifest's digests authenticate them):
    # a damaged one is said, and the files of the others are still checked.
    def damaged_page(rel: str, e: CheckpointError) -> None:
        problems.append(("page", f"step {step}: {e}", resolve_file(step, rel) or rel))

    try:
        listed, file_ends = m.every_file(damaged_page), m.chunk_file_ends(pages=m.pages is None)
        for rel, end in (m.pages.file_ends(skip_damaged=True) if m.pages is not None else {}).items():
            file_ends[rel] = max(file_ends.get(rel, 0), end)
    except CheckpointError as e:  # (two pages that list one file)
        problems.append(("page", f"step {step}: {e}", ""))
        listed, file_ends = m.files, m.chunk_file_ends(pages=False)
    for rel, end in file_ends.items():
        path = resolve_file(step, rel)
        if path is not None:
            ends[path] = max(ends.get(path, 0), end)
    own = {p: info.get("size_bytes") for rel, info in listed.items() if (p := resolve_file(step, rel))}
    paths = sorted(set(ends) | set(own))
    for path in paths:
        where = storage.describe(path)
        if not is_data_path(path):  # a page: plaintext, read (its size and digest checked) above
            continue
        try:
            size = storage.size(path)
            header, _ = read_header(storage, path)
        except CheckpointNotFoundError:
            problems.append(("missing-file", f"step {step}: file {where} is missing", path))
            continue
        except (CheckpointError, ValueError) as e:
            problems.append(("header", f"step {step}: file {where}: {e}", path))
            continue
        rest = size - header
        blocks = max(1, -(-rest // (BLOCK + TAG)))
        plain = rest - blocks * TAG
        if plain < 0 or stored_size(plain, header) != size:
            problems.append(
                (
                    "size",
                    f"step {step}: file {where} is {size} bytes, not a whole number of encrypted blocks (truncated?)",
                    path,
                )
            )
        elif path in own and own[path] != plain:
            problems.append(
                (
                    "size",
                    f"step {step}: file {where} holds {plain} plaintext bytes, the manifest records {own[path]}",
                    path,
                )
            )
        elif ends.get(path, 0) > plain:
            problems.append(
                (
                    "size",
                    f"step {step}: file {where} holds {plain} plaintext bytes, its chunks reach {ends[path]}",
                    path,
                )
            )
    return len(paths), problems


__all__ = [
    "ALGORITHM",
    "BLOCK",
    "MAGIC",
    "MAX_HEADER",
    "TAG",
    "block_aad",
    "block_nonce",
    "files_look_encrypted",
    "is_data_path",
    "is_manifest_path",
    "keyless_problems",
    "read_header",
    "root_identity",
    "stored_size",
]
