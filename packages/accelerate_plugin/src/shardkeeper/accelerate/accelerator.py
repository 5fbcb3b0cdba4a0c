"""``ShardkeeperAccelerator``: an ``Accelerator`` with shardkeeper enabled, for swapping in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate import Accelerator
from shardkeeper.accelerate.plugin import enable


class ShardkeeperAccelerator(Accelerator):
    """``Accelerator(...)`` whose ``save_state`` / ``load_state`` go through shardkeeper.

    ``shardkeeper_root`` and ``shardkeeper_options`` are ``enable()``'s arguments; every
    other argument is Accelerate's.
    """

    def __init__(
        self,
        *args: Any,
        shardkeeper_root: str | None = None,
        shardkeeper_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shardkeeper = enable(self, root=shardkeeper_root, **dict(shardkeeper_options or {}))


__all__ = ["ShardkeeperAccelerator"]
