"""A storage made slow on purpose, for the workers that need a save or an upload still running
when something else happens (the next save, a second writer, a signal, a rank's death)."""

from __future__ import annotations

import time
from fnmatch import fnmatch
from typing import Any

from shardkeeper.core.storage.wrapper import StorageWrapper


class Slow(StorageWrapper):
    """``inner`` whose puts of paths matching ``manifests`` (a manifest's commit), and whose
    writers opened on paths matching ``data``, first sleep ``delay_s`` (None: never)."""

    def __init__(
        self, inner: Any, delay_s: float, *, manifests: str | None = "*manifest.json", data: str | None = None
    ) -> None:
        super().__init__(inner)
        self.delay_s, self.manifests, self.data = delay_s, manifests, data

    def put_if_absent(self, path: str, data: bytes) -> None:
        if self.manifests is not None and fnmatch(path, self.manifests):
            time.sleep(self.delay_s)
        self.inner.put_if_absent(path, data)

    def open_writer(self, path: str) -> Any:
        if self.data is not None and fnmatch(path, self.data):
            time.sleep(self.delay_s)
        return self.inner.open_writer(path)
