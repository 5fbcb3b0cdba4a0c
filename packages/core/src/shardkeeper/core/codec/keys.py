"""Key-encryption keys (KEKs) for client-side encryption: the provider protocol and the
built-in providers (environment variable, key file). See docs/codecs.md, "Encryption".

A provider wraps the random per-file data keys (and per-manifest MAC keys) of a checkpoint;
only wrapped keys are stored. A KMS is plugged in by any object with ``key_id``, ``wrap``
and ``unwrap`` (``KeyProvider``): the KEK then never leaves the KMS.
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any, Protocol, runtime_checkable

from shardkeeper.core.errors import CorruptCheckpointError, EncryptionKeyError


@runtime_checkable
class KeyProvider(Protocol):
    """Wraps and unwraps data keys with a key-encryption key (KEK).

    ``wrap(data_key) -> (key_id, wrapped)``: ``key_id`` names the KEK (stored in plain beside
    the wrapped key, so a reader can tell a wrong key from damage). ``unwrap(key_id, wrapped)
    -> data_key``: raise :class:`EncryptionKeyError` for a key id it does not hold and
    :class:`CorruptCheckpointError` when ``wrapped`` does not unwrap (tampered). Thread-safe.
    """

    key_id: str

    def wrap(self, data_key: bytes) -> tuple[str, bytes]: ...

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes: ...


def require_cryptography() -> Any:
    """The ``cryptography`` package, or an ImportError that names the extra to install."""
    try:
        import cryptography.hazmat.primitives.ciphers.aead as aead
    except ImportError as e:
        raise ImportError(
            "encryption= (and reading an encrypted checkpoint) needs the cryptography package: "
            "pip install 'shardkeeper-core[crypto]'"
        ) from e
    return aead


def fingerprint(kek: bytes) -> str:
    """A KEK's public id: 16 hex digits of HKDF-SHA256(kek, info="shardkeeper key id").
    Reveals nothing usable about the key; tells a wrong key from damage."""
    require_cryptography()
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"shardkeeper key id").derive(kek)
    return "sha256:" + hashlib.sha256(derived).hexdigest()[:16]


class LocalKeyProvider:
    """A 256-bit KEK held in this process; data keys are wrapped with AES key wrap (RFC 3394)."""

    def __init__(self, kek: bytes, source: str = "a key") -> None:
        if len(kek) != 32:
            raise ValueError(f"{source}: an AES-256 key-encryption key is 32 bytes, got {len(kek)}")
        self._kek = kek
        self.source = source
        self.key_id = fingerprint(kek)

    def handover(self) -> tuple[bytes, str]:
        """The key and its source, for the manager's own persist process (``writer="process"``),
        which gets them over a channel only the two processes hold."""
        return self._kek, self.source

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        from cryptography.hazmat.primitives.keywrap import aes_key_wrap

        return self.key_id, aes_key_wrap(self._kek, data_key)

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap

        if key_id != self.key_id:
            raise EncryptionKeyError(f"encrypted with key {key_id}, but {self.source} is key {self.key_id}: wrong key")
        try:
            return aes_key_unwrap(self._kek, wrapped)
        except (InvalidUnwrap, ValueError) as e:
            raise CorruptCheckpointError(
                f"a wrapped key for key {key_id} does not unwrap with {self.source} (whose id "
                f"matches): the stored wrapped key was tampered with or damaged"
            ) from e

    def __repr__(self) -> str:
        return f"LocalKeyProvider({self.source}, key_id={self.key_id})"


def _decode_key(text: str, source: str) -> bytes:
    try:
        kek = base64.b64decode(text.strip(), validate=True)
    except ValueError as e:
        raise ValueError(f"{source} is not base64 ({e}); make one with: head -c 32 /dev/urandom | base64") from None
    if len(kek) != 32:
        raise ValueError(
            f"{source} holds {len(kek)} bytes, an AES-256 key is 32; make one with: head -c 32 /dev/urandom | base64"
        )
    return kek


def env_key(var: str) -> LocalKeyProvider:
    """The KEK in environment variable ``var`` (base64 of 32 bytes)."""
    text = os.environ.get(var)
    if not text:
        raise ValueError(f"encryption='env:{var}': the environment variable {var} is not set")
    return LocalKeyProvider(_decode_key(text, f"environment variable {var}"), f"environment variable {var}")


def file_key(path: str) -> LocalKeyProvider:
    """The KEK in file ``path``: 32 raw bytes, or base64 of them (one line)."""
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as e:
        raise ValueError(f"encryption='file:{path}': cannot read the key file: {e}") from None
    kek = data if len(data) == 32 else _decode_key(data.decode("ascii", "replace"), f"key file {path}")
    return LocalKeyProvider(kek, f"key file {path}")


def key_provider(spec: Any) -> KeyProvider | None:
    """``encryption=`` as given to a manager: None, a KeyProvider, ``"env:VAR"`` or ``"file:PATH"``."""
    if spec is None:
        return None
    if isinstance(spec, str):
        require_cryptography()
        kind, _, arg = spec.partition(":")
        if kind == "env" and arg:
            return env_key(arg)
        if kind == "file" and arg:
            return file_key(arg)
        raise ValueError(f"encryption={spec!r}; use 'env:VAR', 'file:PATH' or a KeyProvider object")
    if isinstance(spec, KeyProvider):
        require_cryptography()
        return spec
    raise TypeError(f"encryption= takes 'env:VAR', 'file:PATH' or a KeyProvider, got {type(spec).__name__}")


__all__ = [
    "EncryptionKeyError",  # defined in errors; re-exported for the modules that still import it from here
    "KeyProvider",
    "LocalKeyProvider",
    "env_key",
    "file_key",
    "fingerprint",
    "key_provider",
    "require_cryptography",
]
