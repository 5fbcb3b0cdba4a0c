"""Whether the hook is installed: the class-level patch of ``Strategy.checkpoint_io`` that
:func:`shardkeeper.lightning.install` sets (:mod:`shardkeeper.lightning.hook`) and a plugin
checks when it is built (one that no Trainer would ever connect is refused)."""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy
from shardkeeper.core.adapter import Patches

#: The class-level patches of ``install()``: ``Strategy.checkpoint_io`` and the ``.ckpt`` loader.
INSTALLED = Patches()


def installed() -> bool:
    """Whether the hook is installed (importing :mod:`shardkeeper.lightning` installs it)."""
    return INSTALLED.patched(Strategy, "checkpoint_io")


__all__ = ["INSTALLED", "installed"]
