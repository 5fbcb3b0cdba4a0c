"""Storage backends behind one small protocol (see ``base``)."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.core.storage.base import Capabilities, Storage, Writer
from shardkeeper.core.storage.local import LocalStorage


def open_storage(root: str | os.PathLike[str] | Storage, **options: Any) -> Storage:
    """The backend for ``root``: a local path (or ``file://`` URL) or any fsspec URL.

    ``s3://`` needs ``shardkeeper-core[s3]``, ``gs://`` needs ``shardkeeper-core[gcs]``.
    """
    if isinstance(root, (LocalStorage,)) or (not isinstance(root, (str, os.PathLike)) and isinstance(root, Storage)):
        return root
    text = os.fspath(root)
    if "://" not in text or text.startswith("file://"):
        path = text[len("file://") :] if text.startswith("file://") else text
        return LocalStorage(path, **options)
    from shardkeeper.core.storage.fsspec_store import FsspecStorage

    return FsspecStorage(text, **options)


__all__ = ["Capabilities", "LocalStorage", "Storage", "Writer", "open_storage"]
