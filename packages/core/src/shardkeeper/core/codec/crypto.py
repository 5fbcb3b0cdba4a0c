"""Client-side encryption: AES-256-GCM data files and HMAC-authenticated manifests.

:class:`EncryptedStorage` wraps a checkpoint root's storage. Data files (``step-*/data/*``)
are encrypted *below* the format: the writer's bytes (a safetensors or framed file, zstd
frames included, so encryption comes after compression) are cut into ``BLOCK`` (64 KiB)
plaintext blocks, each sealed with AES-256-GCM under the file's own random 256-bit data key,
nonce = the block index (unique: a data key encrypts one file once), associated data = the
root's identity (``root_identity``), the file's root-relative path, the block index and a
last-block flag (no swapping, reordering, truncation or moving of blocks or files, within a
root or from another root under the same key). The data key is wrapped by the key provider and
stored in the file's header. Offsets and sizes seen above this layer are plaintext ones, so
chunk records, digests, ranged and partial reads, references of incremental saves (the
wrapped key travels in the file that holds the bytes) and compression work unchanged; a
ranged read reads and opens only the blocks it overlaps.

Manifests stay readable JSON (names, shapes, sizes and digests are visible) and are
authenticated: :func:`seal_manifest` appends an ``"encryption"`` member whose HMAC-SHA256
(under a random per-manifest key, wrapped by the provider) covers every other byte, the
root it is bound to included;
:meth:`EncryptedStorage.read_bytes` checks it before anything of the step is read.

Stored data file: ``SKCRYPT1`` | u32 LE header length | header JSON (``alg``, ``block``,
``key_id``, ``wrapped``, ``root``) | blocks, each ciphertext + 16-byte tag; every block holds
``block`` plaintext bytes except the last (0 .. block). See docs/format.md, section 4.2.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import os
import struct
import threading
from dataclasses import dataclass, replace
from typing import Any

from shardkeeper.core.codec.keys import EncryptionKeyError, KeyProvider, require_cryptography
from shardkeeper.core.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError
from shardkeeper.core.format.layout import DATA_DIR, parse_step_dir
from shardkeeper.core.format.untrusted import loads_untrusted
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.storage.wrapper import StorageWrapper

MAGIC = b"SKCRYPT1"
ALGORITHM = "AES-256-GCM"
BLOCK = 64 << 10
TAG = 16
MAX_HEADER = 64 << 10
_AAD_PREFIX = b"shardkeeper/aes-256-gcm/v1\0"
_AAD_PREFIX_V2 = b"shardkeeper/aes-256-gcm/v2\0"  # v2: the root's identity is bound too
_SCHEMES = {"gcs": "gs", "s3a": "s3"}
_FLUSH = 4 << 20
#: A ranged read is done in windows of this many blocks (~16 MiB): bounded scratch memory
#: per I/O thread, and few enough requests on an object store.
_READ_BLOCKS = 256
_MAC_TAIL = len(b'"}}') + 64  # the manifest ends with "mac":"<64 hex>"}}


def is_data_path(path: str) -> bool:
    parts = path.split("/")
    return len(parts) >= 3 and parts[-2] == DATA_DIR and parse_step_dir(parts[-3]) is not None


def is_manifest_path(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and parts[1] == "manifest.json" and parse_step_dir(parts[0]) is not None


def _nonce(i: int) -> bytes:
    return struct.pack(">4xQ", i)


def _aad(path: str, i: int, final: bool, root: str | None) -> bytes:
    """A block's associated data: its file's root (the binding; None in files written before
    roots were bound), root-relative path, index and last-block flag."""
    if root is None:
        return _AAD_PREFIX + path.encode() + struct.pack(">xQ?", i, final)
    r = root.encode("utf-8", "surrogateescape")
    return _AAD_PREFIX_V2 + struct.pack(">I", len(r)) + r + path.encode() + struct.pack(">xQ?", i, final)


def root_identity(url: str) -> str:
    """What encrypted files and manifests are bound to by default: the root's real path on
    local disk (the same through any symlink to it), its normalized URL on an object store."""
    if "://" not in url or url.startswith("file://"):
        return os.path.realpath(url[len("file://"):] if url.startswith("file://") else url)
    scheme, rest = url.split("://", 1)
    return f"{_SCHEMES.get(scheme, scheme)}://{rest.rstrip('/')}"


def stored_size(plain: int, header: int) -> int:
    n = max(1, -(-plain // BLOCK))
    return header + plain + n * TAG


class _EncWriter:
    """Buffers up to one block; a block goes out only when more bytes follow it, so the
    last block (flagged final in its associated data) is known at ``close``. Ciphertext is
    gathered into fresh ~4 MiB buffers (a retrying writer keeps references to them)."""

    def __init__(self, inner: Writer, path: str, aead: Any, header: bytes, root: str) -> None:
        self._inner, self._path, self._aead, self._root = inner, path, aead, root
        self._into = getattr(aead, "encrypt_into", None)
        self._buf = bytearray()
        self._header = header
        self._out = bytearray(_FLUSH + BLOCK + TAG)
        self._n = 0
        self._i = 0

    def _emit(self, block: Any, final: bool) -> None:
        if self._header:
            self._inner.write(self._header)
            self._header = b""
        k = len(block) + TAG
        nonce, aad = _nonce(self._i), _aad(self._path, self._i, final, self._root)
        if self._into is not None:
            self._into(nonce, block, aad, memoryview(self._out)[self._n : self._n + k])
        else:
            self._out[self._n : self._n + k] = self._aead.encrypt(nonce, bytes(block), aad)
        self._n += k
        self._i += 1
        if self._n >= _FLUSH or final:
            self._inner.write(memoryview(self._out)[: self._n])
            self._out = bytearray(_FLUSH + BLOCK + TAG) if not final else bytearray()
            self._n = 0

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        n, pos = len(mv), 0
        if self._buf:
            pos = min(BLOCK - len(self._buf), n)
            self._buf += mv[:pos]
            if len(self._buf) < BLOCK or pos == n:
                return
            self._emit(self._buf, False)
            self._buf = bytearray()
        while n - pos > BLOCK:
            self._emit(mv[pos : pos + BLOCK], False)
            pos += BLOCK
        self._buf += mv[pos:]

    def close(self) -> None:
        self._emit(self._buf, True)
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


@dataclass(frozen=True)
class _FileInfo:
    header: int  # stored bytes before the first block
    plain: int  # plaintext size
    blocks: int
    key_id: str
    wrapped: bytes
    root: str | None = None  # the root the header says the file was written under (None: unbound)
    aead: Any = None  # set once the data key is unwrapped (sizes need no key)


class EncryptedStorage(StorageWrapper):
    """A Storage whose data files are AES-256-GCM encrypted and whose manifests must carry
    a valid MAC (see the module docstring). Everything else passes through."""

    def __init__(
        self, inner: Storage, provider: KeyProvider, *, authenticate: bool = False, root: str | None = None
    ) -> None:
        """``root``: the identity files and manifests are bound to (default: ``root_identity``
        of ``inner.url``); pass the original one to read a root that was moved or copied."""
        self._aead_mod = require_cryptography()
        from cryptography.exceptions import InvalidTag

        self._invalid_tag = InvalidTag
        super().__init__(inner)
        self.provider = provider
        self._files: dict[str, _FileInfo] = {}
        self._keys: dict[tuple[str, bytes], bytes] = {}
        self._lock = threading.Lock()
        self.authenticate = authenticate
        self.binding = root if root is not None else root_identity(inner.url)
        try:
            self.binding.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"encrypted checkpoints are bound to their root's name, and {self.binding!r} is not valid "
                f"Unicode (a path that is not UTF-8); pass encryption_root= a name that is, e.g. the "
                f"run's name"
            ) from None

    def authenticated(self) -> EncryptedStorage:
        """A view (sharing keys and caches) whose manifest reads fail unless the manifest's
        MAC checks out: for restores, incremental bases, verify and export. The plain view
        (listings, retention, gc) judges commits by structure alone, as without encryption,
        so a wrong key never makes committed steps look like garbage."""
        view = copy.copy(self)
        view.authenticate = True
        return view

    # -- keys ----------------------------------------------------------------------------------
    def _unwrap(self, key_id: str, wrapped: bytes, where: str) -> bytes:
        with self._lock:
            key = self._keys.get((key_id, wrapped))
        if key is None:
            try:
                key = self.provider.unwrap(key_id, wrapped)
            except EncryptionKeyError as e:
                raise EncryptionKeyError(
                    f"{where}: {e}. Pass the key this checkpoint was written with "
                    f"(CheckpointManager(..., encryption=...))"
                ) from None
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{where}: {e}; restore another step") from None
            with self._lock:
                self._keys[(key_id, wrapped)] = key
        return key

    # -- data files ------------------------------------------------------------------------------
    def _info(self, path: str, key: bool = True) -> _FileInfo:
        """The file's layout (from its header and size) and, with ``key``, its unwrapped data
        key; cached per path (data files are immutable)."""
        with self._lock:
            info = self._files.get(path)
        if info is None:
            info = self._layout(path)
        if key and info.aead is None:
            try:
                data_key = self._unwrap(info.key_id, info.wrapped, f"{self.inner.describe(path)} (data key)")
            except EncryptionKeyError as e:
                # Data is read only under a manifest that authenticated with this key: a file
                # under another key was replaced (damage; restore falls back), not a wrong key.
                raise ChecksumMismatchError(
                    f"{e}; its manifest authenticated with this key, so the file was replaced or "
                    f"tampered with: restore another step and run `shardkeeper verify`", file=path,
                ) from None
            info = replace(info, aead=self._aead_mod.AESGCM(data_key))
        with self._lock:
            self._files[path] = info
        return info

    def _layout(self, path: str) -> _FileInfo:
        where = self.inner.describe(path)
        size = self.inner.size(path)
        head = self.inner.read_range(path, 0, min(size, 12))
        if len(head) < 12 or head[:8] != MAGIC:
            raise CorruptCheckpointError(
                f"{where} is not an encrypted shardkeeper file (no {MAGIC.decode()} header) although "
                f"the checkpoint is read with encryption=: it was replaced, or the step was written "
                f"without encryption; restore another step"
            )
        (n,) = struct.unpack("<I", head[8:12])
        if n > MAX_HEADER or 12 + n > size:
            raise CorruptCheckpointError(f"{where}: encryption header of {n} bytes is damaged; restore another step")
        try:
            h = loads_untrusted(self.inner.read_range(path, 12, n), max_bytes=MAX_HEADER)
            key_id, wrapped, alg, block = h["key_id"], base64.b64decode(h["wrapped"]), h["alg"], h["block"]
            root = h.get("root")
            if type(key_id) is not str:
                raise TypeError(f"key_id is {type(key_id).__name__}, not a string")
            if root is not None and type(root) is not str:
                raise TypeError(f"root is {type(root).__name__}, not a string")
        except (ValueError, KeyError, TypeError) as e:  # UntrustedJSONError is a ValueError
            raise CorruptCheckpointError(f"{where}: encryption header is damaged ({e}); restore another step") from None
        if alg != ALGORITHM or block != BLOCK:
            raise CorruptCheckpointError(
                f"{where}: encrypted with {alg!r} in blocks of {block}, this shardkeeper reads "
                f"{ALGORITHM} in blocks of {BLOCK}; upgrade shardkeeper-core or restore another step"
            )
        rest = size - 12 - n
        blocks = max(1, -(-rest // (BLOCK + TAG)))
        plain = rest - blocks * TAG
        if plain < 0 or stored_size(plain, 12 + n) != size:
            raise CorruptCheckpointError(
                f"{where}: {size} bytes is not a whole number of encrypted blocks (truncated?); "
                f"restore another step"
            )
        if root is not None and root != self.binding:
            raise CorruptCheckpointError(
                f"{where} is an encrypted file of the root {root!r}, read as part of {self.binding!r}: "
                f"a file of another root was put here (restore another step), or this root was moved "
                f"or copied from there (then pass encryption_root={root!r})"
            )
        return _FileInfo(12 + n, plain, blocks, key_id, wrapped, root)

    def _plain_range(self, path: str, offset: int, length: int) -> _FileInfo:
        """The file's layout, once plaintext bytes [offset, offset + length) are known to be in it."""
        info = self._info(path)
        if offset < 0 or length < 0 or offset + length > info.plain:
            from shardkeeper.core.errors import StorageError

            raise StorageError(
                f"{self.inner.describe(path)}: bytes [{offset}, {offset + length}) lie beyond its "
                f"{info.plain} plaintext bytes"
            )
        return info

    def _read_plain(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with plaintext bytes [offset, offset + len(out)): one ranged read of
        the blocks they overlap; whole blocks are decrypted straight into ``out``. A block that
        fails authentication leaves zeros where its plaintext would go, never the plaintext."""
        length = len(out)
        info = self._plain_range(path, offset, length)
        if length == 0:
            return
        i0, i1 = offset // BLOCK, (offset + length - 1) // BLOCK
        into = getattr(info.aead, "decrypt_into", None)
        stored_end = stored_size(info.plain, info.header)
        blob = memoryview(bytearray(min(i1 - i0 + 1, _READ_BLOCKS) * (BLOCK + TAG)))
        pos = 0
        for w0 in range(i0, i1 + 1, _READ_BLOCKS):  # windows of blocks: one reused buffer
            w1 = min(i1 + 1, w0 + _READ_BLOCKS)
            start = info.header + w0 * (BLOCK + TAG)
            end = min(info.header + w1 * (BLOCK + TAG), stored_end)
            self.inner.read_into(path, start, blob[: end - start])
            for i in range(w0, w1):
                ct = blob[(i - w0) * (BLOCK + TAG) : min((i - w0 + 1) * (BLOCK + TAG), end - start)]
                lo, hi = max(offset - i * BLOCK, 0), min(offset + length - i * BLOCK, len(ct) - TAG)
                aad = _aad(path, i, i == info.blocks - 1, info.root)
                try:
                    if into is not None and lo == 0 and hi == len(ct) - TAG:
                        into(_nonce(i), ct, aad, out[pos : pos + hi])
                    else:
                        out[pos : pos + hi - lo] = memoryview(info.aead.decrypt(_nonce(i), ct, aad))[lo:hi]
                except self._invalid_tag as e:
                    # decrypt_into writes its plaintext before it checks the tag: never leave
                    # unauthenticated bytes in the caller's buffer.
                    out[pos : pos + hi - lo] = bytes(hi - lo)
                    raise ChecksumMismatchError(
                        f"{self.inner.describe(path)}: encrypted block {i} (bytes [{i * BLOCK}, "
                        f"{min((i + 1) * BLOCK, info.plain)})) fails authentication: it was tampered "
                        f"with, moved or damaged; restore another step and run `shardkeeper verify`",
                        file=path,
                    ) from e
                pos += hi - lo

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if is_data_path(path):
            self._plain_range(path, offset, length)  # before allocating what the caller asks for
            out = bytearray(length)
            self._read_plain(path, offset, memoryview(out))
            return bytes(out)
        return self.inner.read_range(path, offset, length)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        if is_data_path(path):
            self._read_plain(path, offset, memoryview(buffer).cast("B"))
        else:
            self.inner.read_into(path, offset, buffer)

    def read_bytes(self, path: str) -> bytes:
        if is_data_path(path):
            return self.read_range(path, 0, self._info(path).plain)
        data = self.inner.read_bytes(path)
        if self.authenticate and is_manifest_path(path):
            open_manifest(data, self, self.inner.describe(path))
        return data

    def size(self, path: str) -> int:
        return self._info(path, key=False).plain if is_data_path(path) else self.inner.size(path)

    def open_writer(self, path: str) -> Writer:
        if not is_data_path(path):
            return self.inner.open_writer(path)
        key = self._aead_mod.AESGCM.generate_key(bit_length=256)
        key_id, wrapped = self.provider.wrap(key)
        header = json.dumps(
            {"alg": ALGORITHM, "block": BLOCK, "key_id": key_id, "wrapped": base64.b64encode(wrapped).decode(),
             "root": self.binding},
            separators=(",", ":"),
        ).encode()
        return _EncWriter(
            self.inner.open_writer(path), path, self._aead_mod.AESGCM(key),
            MAGIC + struct.pack("<I", len(header)) + header, self.binding,
        )

    # -- everything else passes through (StorageWrapper); cached layouts are dropped on delete
    def delete(self, path: str) -> None:
        with self._lock:
            self._files.pop(path, None)
        self.inner.delete(path)

    def delete_dir(self, path: str) -> None:
        with self._lock:
            for p in [p for p in self._files if p.startswith(path.rstrip("/") + "/")]:
                del self._files[p]
        self.inner.delete_dir(path)


# -- manifests ---------------------------------------------------------------------------------


def seal_manifest(data: bytes, provider: KeyProvider, root: str) -> bytes:
    """``data`` (a manifest's JSON object) with an ``"encryption"`` member appended last whose
    ``mac`` (HMAC-SHA256 under a fresh key wrapped by ``provider``) covers all other bytes,
    the ``root`` it is bound to included."""
    if not data.endswith(b"}") or data == b"{}":
        raise ValueError("not a manifest object")
    mac_key = os.urandom(32)
    key_id, wrapped = provider.wrap(mac_key)
    section = {
        "algorithm": ALGORITHM, "block_bytes": BLOCK, "key_id": key_id,
        "wrapped_mac_key": base64.b64encode(wrapped).decode(), "root": root, "mac": "0" * 64,
    }
    body = data[:-1] + b',"encryption":' + json.dumps(section, separators=(",", ":")).encode() + b"}"
    mac = hmac.new(mac_key, body, hashlib.sha256).hexdigest().encode()
    return body[:-_MAC_TAIL] + mac + body[-3:]


def manifest_section(data: bytes) -> dict[str, Any] | None:
    """The ``encryption`` member of a sealed manifest (unauthenticated), or None if it has
    none; a ``ValueError`` says why a member that is there does not parse."""
    at = data.rfind(b',"encryption":{')
    if at < 0 or not data.endswith(b'"}}'):
        return None
    section = loads_untrusted(data[at + len(b',"encryption":') : -1], max_bytes=len(data))
    if not isinstance(section, dict):
        raise ValueError("is not an object")
    return section


def open_manifest(data: bytes, storage: EncryptedStorage, where: str) -> None:
    """Check a manifest's MAC with the provider's key; raise a clear error if it is missing,
    from another key, or wrong (the manifest was changed after it was written)."""
    try:
        section = manifest_section(data)
    except ValueError as e:  # UntrustedJSONError: there, but damaged
        raise CorruptCheckpointError(
            f"manifest {where}: its encryption member {e}, so it cannot be authenticated; the "
            f"manifest is damaged: restore another step"
        ) from None
    if section is None:
        # Damage, not a key problem: "restore the newest" falls back past it to a step that
        # authenticates (a root that was never encrypted fails every step, naming this).
        raise CorruptCheckpointError(
            f"manifest {where} is not encrypted/authenticated, and this manager reads only "
            f"encrypted checkpoints (encryption= is set): it was written without encryption, or "
            f"replaced. Restore another step, or restore it without encryption= if it is yours"
        )
    try:
        key_id, wrapped = str(section["key_id"]), base64.b64decode(section["wrapped_mac_key"])
        mac = str(section["mac"]).encode()
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"manifest {where}: encryption member is damaged ({e}); restore another step") from None
    key = storage._unwrap(key_id, wrapped, f"manifest {where}")
    body = data[:-_MAC_TAIL] + b"0" * 64 + data[-3:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest().encode(), mac):
        raise CorruptCheckpointError(
            f"manifest {where} fails authentication (HMAC-SHA256 mismatch): it was changed after "
            f"it was written; nothing of it was read. Restore another step and run `shardkeeper verify`"
        )
    root = section.get("root")
    if root is not None and root != storage.binding:
        raise CorruptCheckpointError(
            f"manifest {where} was written under the root {root!r} and is read as part of "
            f"{storage.binding!r}: a step of another root was put here (restore another step), or this "
            f"root was moved or copied from there (then pass encryption_root={root!r})"
        )


def files_look_encrypted(storage: Storage, step: int, m: Any) -> bool:
    """Whether the first data file a manifest of ``step`` lists starts as an encrypted file
    does (no key needed): a manifest that claims encryption over plain files was edited."""
    from shardkeeper.core.root_files import resolve_file

    for rel in sorted(m.files):
        path = resolve_file(step, rel)
        if path is None:
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
    from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
    from shardkeeper.core.root_files import resolve_file

    ends: dict[str, int] = {}
    for _, c in m.chunks():
        path = resolve_file(step, c.file)
        if path is not None:
            ends[path] = max(ends.get(path, 0), c.offset + c.length)
    own = {p: info.get("size_bytes") for rel, info in m.files.items() if (p := resolve_file(step, rel))}
    problems: list[tuple[str, str, str]] = []
    paths = sorted(set(ends) | set(own))
    for path in paths:
        where = storage.describe(path)
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
            problems.append(("size", f"step {step}: file {where} is {size} bytes, not a whole number of encrypted blocks (truncated?)", path))
        elif path in own and own[path] != plain:
            problems.append(("size", f"step {step}: file {where} holds {plain} plaintext bytes, the manifest records {own[path]}", path))
        elif ends.get(path, 0) > plain:
            problems.append(("size", f"step {step}: file {where} holds {plain} plaintext bytes, its chunks reach {ends[path]}", path))
    return len(paths), problems
