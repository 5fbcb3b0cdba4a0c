"""A local step's files of which no node holds a copy that checks out, rebuilt from parity
(``erasure=(k, m)``) as if their node's directory were gone, so that a damaged copy never
costs more than a lost node.

A restore's read finds a damaged copy (a node's own, or one ``choose.make_whole`` moved from a
node whose copy was damaged: copies are not checked before they move); ``repair.repair``
replaces it from another node's good copy, and when no copy checks out, rebuilds the file
here (``rebuild.rebuild_damaged``) and replaces the other copies from the rebuilt one.
Without parity, or when the parity does not cover the damage, nothing is rebuilt and the
restore falls back as before. ``rebuilt`` lists the files the restore rebuilt from parity, lost
nodes' files included, every rank alike (``RestoreStats.rebuilt``).
"""

from __future__ import annotations

import logging
from typing import Any

from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.rebuild import rebuild_damaged
from shardkeeper.core.tiers.wire import TierGroup

log = logging.getLogger(__name__)


class Mender:
    """One manager's rebuilds of damaged files (``erasure``: None, no parity: none)."""

    def __init__(self, group: TierGroup, nodes: NodeMap, local: Any, erasure: tuple[int, int] | None) -> None:
        self.group, self.nodes, self.local, self.erasure = group, nodes, local, erasure
        self.rebuilt: list[str] = []  # by the restore in progress (or the last one)
        self._failed: set[int] = set()  # steps whose damaged files parity did not rebuild

    def start(self, rebuilt: list[str]) -> None:
        """A restore begins; ``rebuilt``: the lost nodes' files it rebuilt from parity."""
        self.rebuilt, self._failed = list(rebuilt), set()

    def rebuild(self, step: int, paths: list[str]) -> list[str]:
        """Collective: ``paths`` of ``step``, no copy of which checks out, rebuilt from parity
        on their nodes; the files rebuilt ([] without parity, or once it failed for ``step``)."""
        if self.erasure is None or step in self._failed:
            return []
        if self.group.rank == 0:
            log.warning(
                "rank 0: step %d: no node holds a copy of %s that checks out; rebuilding from parity, its damaged "
                "copies counted as lost",
                step,
                ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else ""),
            )
        got = rebuild_damaged(self.group, self.nodes, self.local, step, paths)
        if not got:
            self._failed.add(step)
        self.rebuilt += [p for p in got if p not in self.rebuilt]
        return got


__all__ = ["Mender"]
