"""Tools to test checkpointing on your own storage: the kill -9 campaign (``campaign``) and
the storage conformance suite every backend must pass (``storage_conformance``; needs pytest).

``python -m shardkeeper.core.testing.campaign ROOT --trials 50`` runs it from the command line
(docs/reliability.md). The names below are loaded on first use, so that importing this package
imports neither torch nor the module that ``python -m`` is about to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardkeeper.core.testing.campaign import (
        KILL_POINTS,
        Summary,
        deterministic_state,
        run_campaign,
    )
    from shardkeeper.core.testing.procs import kill_tree

_LAZY = {
    "KILL_POINTS": "shardkeeper.core.testing.campaign",
    "Summary": "shardkeeper.core.testing.campaign",
    "deterministic_state": "shardkeeper.core.testing.campaign",
    "run_campaign": "shardkeeper.core.testing.campaign",
    "kill_tree": "shardkeeper.core.testing.procs",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardkeeper.core.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = ["KILL_POINTS", "Summary", "deterministic_state", "kill_tree", "run_campaign"]
