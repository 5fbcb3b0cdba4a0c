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

import json
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.errors import CheckpointError, CommitConflictError
from shardkeeper.core.runtime.binding import NODE_TOKEN, ROOT_NAME, bind_root
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.placement import arrange
from shardkeeper.core.tiers.wire import TierGroup


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


def discover(group: TierGroup, storage: Storage, root: str, options: dict[str, Any]) -> NodeMap:
    """Collective: the node map of the group, from each rank's directory token; every rank
    checks that its directory belongs to ``root``, that the ranks passed the same tier
    ``options``, and that no directory is a copy of another's (same token, another place).
    Any failure raises on every rank, naming the ranks."""
    mine: dict[str, Any] = {"options": options, "host": socket.gethostname(), "dir": storage.url, "error": None}
    try:
        bind_root(storage, root)
        mine["token"] = node_token(storage)
    except Exception as e:  # every rank hears it below
        mine["error"] = f"{type(e).__name__}: {e}"
    got = group.all_gather_json(mine, "the local tiers' nodes")
    errors = [f"rank {r}: {g['error']}" for r, g in enumerate(got) if g["error"]]
    if errors:
        raise CheckpointError(f"rank {group.rank}: opening the local tiers failed: {'; '.join(errors)}")
    kinds = {json.dumps(g["options"], sort_keys=True) for g in got}
    if len(kinds) > 1:
        raise ValueError(
            f"{root}, rank {group.rank}: the ranks passed different tier options to CheckpointManager "
            f"({_differing([g['options'] for g in got])}); pass the same on every rank"
        )
    places: dict[str, set[tuple[str, str]]] = {}
    for g in got:
        places.setdefault(g["token"], set()).add((g["host"], g["dir"]))
    for where in places.values():
        if len(where) > 1:
            shown = ", ".join(f"{d} on {h}" for h, d in sorted(where))
            raise CheckpointError(
                f"rank {group.rank}: the local directories {shown} carry the same node token: one is a copy of "
                f"another (a disk snapshot, an rsync). Remove {NODE_TOKEN} from the copies: they then count as nodes "
                f"of their own"
            )
    by_token: dict[str, list[int]] = {}
    for rank, g in enumerate(got):
        by_token.setdefault(g["token"], []).append(rank)
    nodes = NodeMap(tuple(sorted(tuple(r) for r in by_token.values())))
    if options.get("erasure") is not None:
        try:
            arrange(len(nodes.nodes), *options["erasure"])
        except ValueError as e:  # (too few nodes: the same on every rank)
            raise ValueError(f"{root}, rank {group.rank}: {e}") from None
    return nodes


def _differing(options: list[dict[str, Any]]) -> str:
    """Each rank's tier options that differ between the ranks, as passed (a default: "not
    passed")."""
    keys = [k for k in sorted(options[0]) if len({json.dumps(o.get(k)) for o in options}) > 1]

    def shown(key: str, value: Any) -> str:
        if value in (None, 0):
            return f"{key} not passed"
        return f"{key}={tuple(value) if isinstance(value, list) else value!r}"

    return "; ".join(f"rank {r}: {', '.join(shown(k, o.get(k)) for k in keys)}" for r, o in enumerate(options))


__all__ = ["NODE_TOKEN", "ROOT_NAME", "NodeMap", "bind_root", "discover", "node_token"]
