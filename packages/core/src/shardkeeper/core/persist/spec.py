"""What a persist process is told once, at its start: the ``PersistSpec`` it rebuilds the
manager's writer from, checked on the trainer's side when the manager is made."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.persist.channel import decode, encode


@dataclass(frozen=True)
class PersistSpec:
    """The manager a persist process writes for: its root (as given), storage options and
    options; its rank and world; its coordinator's namespace and, with several ranks, the
    address of the c10d store server the persist processes meet on."""

    root: Any
    storage_options: dict[str, Any]
    options: CheckpointOptions
    rank: int
    world_size: int
    namespace: str = ""
    store: tuple[str, int] | None = None
    group_ranks: int = 128


def checked_spec(
    root: Any,
    storage_options: Mapping[str, Any] | None,
    options: CheckpointOptions,
    *,
    rank: int,
    world_size: int,
    namespace: str,
    store: tuple[str, int] | None,
    where: str,
) -> PersistSpec:
    """The spec of a manager with ``writer="process"``, or a ``ValueError`` naming what cannot be
    handed to another process (checked by the channel's own encoding, before any save)."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    spec = PersistSpec(
        root,
        dict(storage_options or {}),
        options,
        rank,
        world_size,
        namespace,
        store,
        options.commit_group_ranks,
    )
    parts = {
        "root": spec.root,
        "storage_options": spec.storage_options,
        "encryption": options.encryption,
        "options": options,
    }
    for name, value in parts.items():
        try:
            decode(encode("hello", value))
        except (pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError):
            kind = type(value).__name__ if name != "storage_options" else "a value in it"
            raise ValueError(
                f"writer='process' (root {where}, rank {rank}): {name}= ({kind}) cannot be handed to the persist "
                f"process, which rebuilds the writer from the core's own types and plain values only. Pass a path "
                f"or URL as the root, storage options of str/int/float/bool, encryption='env:VAR', 'file:PATH' or "
                f"the core's LocalKeyProvider; or use writer='thread'"
            ) from None
    return spec


__all__ = ["PersistSpec", "checked_spec"]
