"""A local commit recorded on every node, through the c10d store (no shared file system).

The coordinator commits the manifest into its own node's directory with the fenced protocol
(``commit/put.py``: every rank reported its files durable and its replicas taken), then
``offer``s the manifest's bytes under the save's keys before it publishes the outcome. Once a
rank hears the commit, ``record`` has each other node's leader put the same bytes into its
node's directory (put-if-absent) and count itself in; every rank then waits until every node
has recorded it, so an acknowledged step is named on every node. A node that could not record
it is named in the error, and the step still restores from the nodes that did.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.errors import CheckpointError, CheckpointSaveError, CheckpointTimeoutError
from shardkeeper.core.runtime.store_channel import StoreTimeout
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.nodes import NodeMap

COORDINATOR = 0


class Recorder:
    """The record of one manager's local commits (``coord``: its StoreCoordinator)."""

    def __init__(self, coord: Any, nodes: NodeMap, timeout_s: float) -> None:
        self.coord, self.nodes, self.timeout_s = coord, nodes, timeout_s

    def _key(self, seq: int, name: str) -> str:
        return f"{self.coord.namespace}/{seq}/tier-{name}"

    def offer(self, seq: int, data: bytes, due: bool) -> None:
        """Coordinator, before its put: the manifest's bytes, and whether the step is
        uploaded (decided once, here, so every rank schedules uploads alike)."""
        store = self.coord.store
        if len(self.nodes.nodes) > 1:
            store.set(self._key(seq, "manifest"), data)
        store.set(self._key(seq, "due"), b"1" if due else b"0")

    def forget(self, seq: int) -> None:
        """Coordinator, when the commit failed after ``offer``: no rank will read the keys."""
        for name in ("manifest", "due"):
            try:
                self.coord.store.delete_key(self._key(seq, name))
            except Exception:  # best effort: the keys are unique to this save
                pass

    def record(self, seq: int, step: int, storage: Storage) -> bool:
        """Every rank, once the step is committed: other nodes' leaders write the manifest
        into their directory (``storage``, the node's as the save writes it); all wait until
        every node has. Returns whether the step is uploaded. Raises ``CheckpointSaveError``
        naming the nodes that could not record it."""
        store, me = self.coord.store, self.coord.rank
        due = store.get(self._key(seq, "due")) == b"1"  # set before the outcome every rank heard
        others = len(self.nodes.nodes) - 1
        if others == 0:
            if store.add(self._key(seq, "acks"), 1) == self.coord.world_size:
                store.delete_key(self._key(seq, "due"))
                store.delete_key(self._key(seq, "acks"))
            return cast("bool", due)
        home = self.nodes.node_of(COORDINATOR)
        if self.nodes.is_leader(me) and self.nodes.node_of(me) != home:
            try:
                data = store.get(self._key(seq, "manifest"))
                try:
                    storage.put_if_absent(manifest_path(step), data)
                except CheckpointError:
                    if storage.read_bytes(manifest_path(step)) != data:
                        raise
            except Exception as e:
                store.set(self._key(seq, f"failed/{me}"), f"{type(e).__name__}: {e}")
                store.add(self._key(seq, "failures"), 1)
            if store.add(self._key(seq, "recorded"), 1) == others:
                store.set(self._key(seq, "done"), b"1")
        try:
            store.wait([self._key(seq, "done")], timedelta(seconds=self.timeout_s))
        except StoreTimeout as e:
            raise CheckpointTimeoutError(
                f"step {step}, rank {me}: committed on node {home}'s local tier, but not every node recorded it "
                f"within {self.timeout_s:.0f} s (a node died or hangs); it restores from the nodes that did"
            ) from e
        failed = int(store.add(self._key(seq, "failures"), 0))
        if failed:
            names = [
                f"rank {r}: {store.get(self._key(seq, f'failed/{r}')).decode(errors='replace')}"
                for r in (self.nodes.leader(k) for k in range(len(self.nodes.nodes)))
                if store.check([self._key(seq, f"failed/{r}")])
            ]
            raise CheckpointSaveError(
                f"step {step} was committed on node {home}'s local tier, but {failed} node(s) could not record its "
                f"manifest ({'; '.join(names)}); it restores while a node that did holds it. Fix those nodes' "
                f"local directories",
                step=step,
            )
        if store.add(self._key(seq, "acks"), 1) == self.coord.world_size:
            for name in ("manifest", "due", "recorded", "done", "failures", "acks"):
                store.delete_key(self._key(seq, name))
        return cast("bool", due)


__all__ = ["Recorder"]
