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
ranged read reads and opens only the blocks it overlaps. Manifest reads of an authenticated
view check the manifest's MAC first (codec/crypto_manifest.py).

Layering: the storage wrapper and its reads only. The writer that seals a data file is in
codec/crypto_writer.py, the stored form of a data file and what can be checked of it without
a key in codec/crypto_format.py, the manifests' MAC in codec/crypto_manifest.py; all sit
below this module, which names the public functions of the last two too, so
``shardkeeper.core.codec.crypto`` keeps the names it always had.
"""

from __future__ import annotations

import base64
import copy
import json
import struct
import threading
from dataclasses import dataclass, replace
from typing import Any

from shardkeeper.core.codec.crypto_format import (
    ALGORITHM,
    BLOCK,
    MAGIC,
    MAX_HEADER,
    TAG,
    block_aad,
    block_nonce,
    bound_name,
    files_look_encrypted,
    is_data_path,
    is_manifest_path,
    keyless_problems,
    root_identity,
    stored_size,
)
from shardkeeper.core.codec.crypto_manifest import open_manifest, seal_manifest
from shardkeeper.core.codec.crypto_writer import EncWriter
from shardkeeper.core.codec.keys import EncryptionKeyError, KeyProvider, require_cryptography
from shardkeeper.core.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError, KeyNotHeldError
from shardkeeper.core.format.untrusted import loads_untrusted
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.storage.wrapper import StorageWrapper

#: A ranged read is done in windows of this many blocks (~16 MiB): bounded scratch memory
#: per I/O thread, and few enough requests on an object store.
_READ_BLOCKS = 256
_WRITTEN = 4096  # files this process wrote whose key ``sealed_under`` knows without a read


@dataclass(frozen=True)
class _FileInfo:
    header: int  # stored bytes before the first block
    plain: int  # plaintext size
    blocks: int
    key_id: str
    wrapped: bytes
    root: str  # the root the header says the file was written under
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
        self._written: dict[str, str] = {}  # data files this process wrote -> their key id (newest last)
        self._lock = threading.Lock()
        self.authenticate = authenticate
        if root is not None and not root.strip():
            raise ValueError(
                "encryption_root is empty; it names the root the checkpoints are bound to (the root's original "
                "path or URL, or the run's name): give one, or leave it unset for this root's own"
            )
        self.binding = bound_name(root) if root is not None else root_identity(inner.url)
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
            except EncryptionKeyError:  # (under a manifest that authenticated: not a wrong key)
                k = info.key_id
                raise KeyNotHeldError(
                    f"{self.inner.describe(path)} is sealed under key {k}, which the key provider (wrapping "
                    f"with {getattr(self.provider, 'key_id', '?')}) does not hold, though the step's manifest "
                    f"authenticated: a file sealed before a key rotation that the step still references (read "
                    f"with a provider that still unwraps {k}; `shardkeeper keys ROOT` lists the key ids each "
                    f"step needs), or, if this root never used {k}, a file put in place of the step's own: "
                    f"restore another step",
                    key_id=k,
                    file=path,
                ) from None
            info = replace(info, aead=self._aead_mod.AESGCM(data_key))
        with self._lock:
            self._files[path] = info
        return info

    def sealed_under(self, path: str) -> str | None:
        """The id of the key data file ``path`` is sealed under, from its header (no key is
        needed; a file this process wrote is known without a read), or None when its header
        cannot be read. An incremental save references a file only under the key it wraps with."""
        with self._lock:
            known = self._written.get(path)
            info = self._files.get(path)
        if known is not None:
            return known
        if info is not None:
            return info.key_id
        try:
            return self._info(path, key=False).key_id
        except CheckpointError:
            return None

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
            if type(root) is not str:
                raise TypeError("it names no root it is bound to" if root is None else "root is not a string")
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
                f"{where}: {size} bytes is not a whole number of encrypted blocks (truncated?); restore another step"
            )
        if bound_name(root) != self.binding:
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
                aad = block_aad(path, i, i == info.blocks - 1, info.root)
                try:
                    if into is not None and lo == 0 and hi == len(ct) - TAG:
                        into(block_nonce(i), ct, aad, out[pos : pos + hi])
                    else:
                        out[pos : pos + hi - lo] = memoryview(info.aead.decrypt(block_nonce(i), ct, aad))[lo:hi]
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
            open_manifest(data, self._unwrap, self.binding, self.inner.describe(path))
        return data

    def size(self, path: str) -> int:
        return self._info(path, key=False).plain if is_data_path(path) else self.inner.size(path)

    def open_writer(self, path: str) -> Writer:
        if not is_data_path(path):
            return self.inner.open_writer(path)
        key = self._aead_mod.AESGCM.generate_key(bit_length=256)
        key_id, wrapped = self.provider.wrap(key)
        with self._lock:
            self._written.pop(path, None)
            self._written[path] = key_id
            if len(self._written) > _WRITTEN:
                del self._written[next(iter(self._written))]
        header = json.dumps(
            {
                "alg": ALGORITHM,
                "block": BLOCK,
                "key_id": key_id,
                "wrapped": base64.b64encode(wrapped).decode(),
                "root": self.binding,
            },
            separators=(",", ":"),
        ).encode()
        return EncWriter(
            self.inner.open_writer(path),
            path,
            self._aead_mod.AESGCM(key),
            MAGIC + struct.pack("<I", len(header)) + header,
            self.binding,
        )

    # -- everything else passes through (StorageWrapper); cached layouts are dropped on delete
    def delete(self, path: str) -> None:
        with self._lock:
            self._files.pop(path, None)
            self._written.pop(path, None)
        self.inner.delete(path)

    def delete_dir(self, path: str) -> None:
        with self._lock:
            for cache in (self._files, self._written):
                for p in [p for p in cache if p.startswith(path.rstrip("/") + "/")]:
                    del cache[p]
        self.inner.delete_dir(path)


__all__ = [
    "BLOCK",
    "MAGIC",
    "TAG",
    "EncryptedStorage",
    "files_look_encrypted",
    "keyless_problems",
    "seal_manifest",
]
