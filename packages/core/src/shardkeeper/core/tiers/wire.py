"""The tiers' own gloo group and what travels over it: bytes, JSON and files, as uint8
tensors (no pickle). Made once per manager on a prefix of the coordinator's c10d store, a
collective of the manager's ranks only, never the training group; every operation is bounded
by the group's timeout and raises ``CheckpointTimeoutError`` naming what was exchanged."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core.errors import CheckpointTimeoutError
from shardkeeper.core.tensor import _torch_compat as tc


def _waited(work: Any, where: str) -> None:
    try:
        work.wait()
    except Exception as e:  # gloo's own error types: connection closed, timeout
        raise CheckpointTimeoutError(
            f"{where} failed or timed out ({e}); a rank died or hangs. Restart the job: the newest step "
            f"whole in some tier is restored"
        ) from e


@dataclass(frozen=True)
class TierCoord:
    """Where the tiers' ranks meet: a c10d store (the process group's, or a ``HashStore`` for
    one process), a namespace of keys unique to the manager, its rank and world size."""

    store: Any
    namespace: str
    rank: int
    world_size: int

    @classmethod
    def of(cls, coord: Any) -> TierCoord:
        """The tiers' coordinates of a manager's coordinator."""
        if coord.world_size == 1 and not hasattr(coord, "namespace"):
            return cls(dist.HashStore(), "shardkeeper/local", 0, 1)
        return cls(tc.group_store(coord.group), coord.namespace, coord.rank, coord.world_size)


class TierGroup:
    """A gloo group of the manager's ranks for the tiers alone (``coord``: a ``TierCoord``)."""

    def __init__(self, coord: Any, timeout_s: float) -> None:
        store = dist.PrefixStore(f"{coord.namespace}/tiers", coord.store)
        self.rank, self.world_size = coord.rank, coord.world_size
        self.pg: Any = dist.ProcessGroupGloo(store, coord.rank, coord.world_size, timedelta(seconds=timeout_s))

    def all_gather_ints(self, values: list[int], where: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank)."""
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        _waited(self.pg.allgather([out], [t]), where)
        return [o.tolist() for o in out]

    def all_reduce_max(self, values: list[int], where: str) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # the stubs: RedOpType vs ReduceOp
        _waited(self.pg.allreduce([t], opts), where)
        return [int(v) for v in t.tolist()]

    def all_gather_bytes(self, data: bytes, where: str) -> list[bytes]:
        """Every rank's ``data`` (any lengths)."""
        sizes = [s[0] for s in self.all_gather_ints([len(data)], where)]
        width = max(1, max(sizes))
        t = torch.zeros(width, dtype=torch.uint8)
        if data:
            t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
        _waited(self.pg.allgather([out], [t]), where)
        return [bytes(o[:n].numpy().tobytes()) for o, n in zip(out, sizes)]

    def all_gather_json(self, value: Any, where: str) -> list[Any]:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(value, sort_keys=True).encode(), where)]

    def broadcast_bytes(self, data: bytes | None, root: int, where: str) -> bytes:
        """``root``'s ``data`` on every rank."""
        n = torch.tensor([len(data or b"")], dtype=torch.int64)
        self._broadcast(n, root, where)
        t = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == root and data:
            t[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(t):
            self._broadcast(t, root, where)
        return bytes(t.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, root: int, where: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        _waited(self.pg.broadcast([t], opts), where)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.pg.recv([t], src, tag)

    def wait(self, work: Any, where: str) -> None:
        _waited(work, where)


__all__ = ["TierCoord", "TierGroup"]
