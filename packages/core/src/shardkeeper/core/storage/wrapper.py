"""The base of storage wrappers: a ``Storage`` that hands everything it does not override to
the storage it wraps.

Fault injection (``faults.FaultyStorage``), retries (``retry.RetryingStorage``), encryption
(``codec.crypto.EncryptedStorage``) and the kill campaign's wrapper stack on any backend; each
overrides only the operations it changes. ``url`` and ``capabilities`` are the inner
storage's (setting them sets the inner's), and backend extras (``fs``, ``root``, ...) are
looked up on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkeeper.core.storage.base import Capabilities, Storage, sizes_of


class StorageWrapper:
    """Delegates to ``inner`` every attribute and operation a subclass does not define."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return self.inner.url

    @url.setter
    def url(self, value: str) -> None:
        self.inner.url = value

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        self.inner.capabilities = value

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def sizes(self, paths: Sequence[str]) -> list[int]:
        """``sizes_of`` the inner storage (``sizes_of`` asks a subclass that defines its own
        ``size``, a fault per path, a plaintext size, path by path instead)."""
        return sizes_of(self.inner, paths)

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally; before __init__ sets ``inner`` (copy,
        # pickle) there is nothing to delegate to.
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


__all__ = ["StorageWrapper"]
