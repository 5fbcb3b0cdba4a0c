"""The writer that seals a data file in AES-256-GCM blocks as its bytes arrive (codec/crypto.py)."""

from __future__ import annotations

from typing import Any

from shardkeeper.core.codec.crypto_format import BLOCK, TAG, block_aad, block_nonce
from shardkeeper.core.storage.base import Writer

_FLUSH = 4 << 20


class EncWriter:
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
        nonce, aad = block_nonce(self._i), block_aad(self._path, self._i, final, self._root)
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


__all__ = ["EncWriter"]
