"""Which ranks share a node-local directory, and where each rank's replicas go.

A node is found by what it holds, not by its name: every rank puts a random token into its
local directory with put-if-absent (the first rank of a directory wins) and reads it back, and
the ranks that read the same token write into the same directory. Two simulated nodes on one
host (a directory each) are two nodes; a replaced node's empty directory is a new one. Nodes
are numbered by their lowest rank, which leads the node (it lists, records and retains).

Replica ``j`` (1..replicas) of rank ``r`` goes to node ``(n + j) % nodes`` of ``r``'s node
``n``, to the rank there at ``r``'s position within its node (modulo that node's size), so
replicas lie on other nodes and spread over their ranks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from shardkeeper.core.errors import CheckpointError, CommitConflictError
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.wire import TierGroup

#: The token file at the top of every local directory.
NODE_TOKEN = ".shardkeeper-node"


@dataclass(frozen=True)
class NodeMap:
    """``nodes[k]``: the ranks of node ``k``, ascending; nodes ordered by their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        for k, ranks in enumerate(self.nodes):
            if rank in ranks:
                return k
        raise KeyError(rank)

    def leader(self, node: int) -> int:
        return self.nodes[node][0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of(rank)) == rank

    def same_node(self, rank: int) -> tuple[int, ...]:
        return self.nodes[self.node_of(rank)]

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that hold ``rank``'s replicas, on ``replicas`` other nodes."""
        n = self.node_of(rank)
        pos = self.nodes[n].index(rank)
        out = []
        for j in range(1, min(replicas, len(self.nodes) - 1) + 1):
            peers = self.nodes[(n + j) % len(self.nodes)]
            out.append(peers[pos % len(peers)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` holds (the inverse of ``targets``), ascending."""
        return sorted(r for ranks in self.nodes for r in ranks if rank in self.targets(r, replicas))


def node_token(storage: Storage) -> str:
    """This directory's token, created by the first rank that asks (``storage``: unencrypted)."""
    try:
        storage.put_if_absent(NODE_TOKEN, secrets.token_hex(16).encode())
    except CommitConflictError:
        pass  # another rank of this node (or an earlier run) made it
    token = storage.read_bytes(NODE_TOKEN).decode("ascii", "replace").strip()
    if len(token) != 32:
        raise CheckpointError(
            f"{storage.describe(NODE_TOKEN)} is not a node token ({token[:40]!r}); remove it and start again"
        )
    return token


def discover(group: TierGroup, storage: Storage) -> NodeMap:
    """Collective: the node map of the group, from each rank's directory token."""
    tokens = [b.decode() for b in group.all_gather_bytes(node_token(storage).encode(), "the local tiers' node tokens")]
    by_token: dict[str, list[int]] = {}
    for rank, token in enumerate(tokens):
        by_token.setdefault(token, []).append(rank)
    return NodeMap(tuple(sorted(tuple(r) for r in by_token.values())))


__all__ = ["NODE_TOKEN", "NodeMap", "discover", "node_token"]
