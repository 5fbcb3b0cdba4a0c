"""One adapter's checkpoint managers: one per root, made with the adapter's options and the
metadata every adapter writes the same way.

Every checkpoint an adapter writes names its framework in the manifest's metadata with the
same keys, so tools (``shardkeeper ls``, the other adapters) can tell who wrote it:

- ``framework``: ``deepspeed`` / ``lightning`` / ``accelerate`` (``torch`` for a plain core save)
- ``framework_version``, and ``<framework>_version`` (the key older checkpoints used)
- ``shardkeeper_version``, ``torch_version``
- ``progress_schema``: the version of the ``progress`` layout (:mod:`shardkeeper.core.format.progress`)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardkeeper.core.format.progress import PROGRESS_SCHEMA
from shardkeeper.core.manager.manager import CheckpointManager
from shardkeeper.core.util.version import shardkeeper_version


def adapter_metadata(framework: str, framework_version: str, **more: Any) -> dict[str, Any]:
    """The metadata of every checkpoint ``framework``'s adapter writes (``more``: its own keys)."""
    return {
        **more,
        "framework": framework,
        "framework_version": str(framework_version),
        f"{framework}_version": str(framework_version),
        "shardkeeper_version": shardkeeper_version(),
        "torch_version": str(torch.__version__),
        "progress_schema": PROGRESS_SCHEMA,
    }


class RootManagers:
    """The managers of one adapter object, one per root, created on first use (a collective:
    every rank asks for the same root in the same order).

    ``options`` go to every manager (``keep_last``, ``storage_options``, ``async_save``, ...);
    a ``metadata`` entry among them is the user's, merged under the contract's keys.
    ``per_rank_call``: the adapter's call where its user sets ``per_rank``
    (``"enable(accelerator, per_rank=...)"``); every error and warning about it names that call.
    """

    def __init__(
        self,
        framework: str,
        framework_version: str,
        options: Mapping[str, Any] | None = None,
        *,
        per_rank_call: str | None = None,
        **metadata: Any,
    ) -> None:
        self.framework = framework
        self.per_rank_call = per_rank_call
        opts = dict(options or {})
        user = dict(opts.pop("metadata", None) or {})
        owned = adapter_metadata(framework, framework_version, **metadata)
        clash = sorted(set(user) & set(owned))
        if clash:
            raise ValueError(
                f"metadata key(s) {', '.join(clash)} are written by the {framework} adapter itself; "
                f"use other names for your own metadata"
            )
        self.options = opts
        self.metadata = {**user, **owned}
        self._managers: dict[str, CheckpointManager] = {}

    def get(self, root: str | os.PathLike[str], **options: Any) -> CheckpointManager:
        """The manager of ``root``; ``options`` (first use only) override the adapter's."""
        root = os.fspath(root)
        mgr = self._managers.get(root)
        if mgr is None:
            try:
                mgr = CheckpointManager(root, metadata=self.metadata, **{**self.options, **options})
            except (TypeError, ValueError) as e:
                if self.per_rank_call is None or not re.search(r"\bper_rank\b", str(e)):
                    raise
                raise type(e)(f"{e} (set it in {self.per_rank_call})") from e
            if self.per_rank_call is not None:
                mgr.per_rank_call = self.per_rank_call
            self._managers[root] = mgr
        return mgr

    def __iter__(self) -> Iterator[CheckpointManager]:
        return iter(list(self._managers.values()))

    def __len__(self) -> int:
        return len(self._managers)

    def wait(self) -> None:
        """Block until every manager's pending save is committed (re-raises a failure)."""
        for mgr in self:
            mgr.wait()

    def close(self) -> None:
        """Wait for and close every manager (each is created again on next use)."""
        try:
            for mgr in self:
                mgr.close()
        finally:
            self._managers.clear()


__all__ = ["RootManagers", "adapter_metadata"]
