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

from shardkeeper.core.errors import CheckpointError, TierGroupBroken
from shardkeeper.core.runtime.store_channel import StoreChannel, gloo_group
from shardkeeper.core.state import _torch_compat as tc


@dataclass(frozen=True)
class TierCoord:
    """Where the tiers' ranks meet: ``store``, the save path's connection to the c10d store
    (the coordinator's channel; a ``HashStore`` for one process), ``group_store`` the store
    itself (the tiers' gloo group meets on it, and each background path opens a connection of
    its own to it: ``store_channel.py``), a namespace of keys unique to the manager, its rank
    and world size."""

    store: Any
    group_store: Any
    namespace: str
    rank: int
    world_size: int

    @classmethod
    def of(cls, coord: Any) -> TierCoord:
        """The tiers' coordinates of a manager's coordinator (or ``coord`` itself, made by a
        persist process: ``process_writer.py``)."""
        if isinstance(coord, TierCoord):
            return coord
        if coord.world_size == 1 and not hasattr(coord, "namespace"):
            local = dist.HashStore()  # in-process: a wait blocks no other caller
            return cls(StoreChannel(local, "the local tier", own=False), local, "shardkeeper/local", 0, 1)
        return cls(coord.save_store, tc.group_store(coord.group), coord.namespace, coord.rank, coord.world_size)

    def channel(self, label: str) -> StoreChannel:
        """A connection of its own to the store, for a path that runs beside the save's."""
        return StoreChannel(self.group_store, label)


class TierGroup:
    """A gloo group of the manager's ranks for the tiers alone (``coord``: a ``TierCoord``)."""

    def __init__(self, coord: Any, timeout_s: float) -> None:
        store = dist.PrefixStore(f"{coord.namespace}/tiers", coord.group_store)
        self.rank, self.world_size = coord.rank, coord.world_size
        # One process needs no group (nor gloo's threads, which a later fork would inherit).
        self.pg: Any = None
        if coord.world_size > 1:
            self.pg = gloo_group(store, coord.rank, coord.world_size, timedelta(seconds=timeout_s), "the tiers' group")
        self.broken: str | None = None  # what broke it: every later operation raises at once

    def _waited(self, work: Any, where: str) -> None:
        try:
            work.wait()
        except Exception as e:  # gloo's own error types: connection closed, timeout
            self.broken = f"{where}: {e}"
            raise TierGroupBroken(
                f"{where} failed or timed out ({e}); a rank died or hangs (its own log names why). Restart "
                f"the job: restore takes the newest step whole in some tier"
            ) from e

    def check(self) -> None:
        """Raise at once when an earlier operation broke the group."""
        if self.broken is not None:
            raise TierGroupBroken(
                f"rank {self.rank}: the tiers' process group broke earlier ({self.broken}); its ranks may be out "
                f"of step, so it is not used again. Restart the job: restore takes the newest step whole in some tier"
            )

    def agree_ok(self, error: BaseException | None, where: str) -> None:
        """Collective: every rank says whether its part failed; any failure raises on every
        rank, naming the ranks and their errors (so that no rank skips a later collective)."""
        errs = self.all_gather_json(None if error is None else f"{type(error).__name__}: {error}", where)
        failed = {r: e for r, e in enumerate(errs) if e is not None}
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            err = CheckpointError(f"{where} failed on {len(failed)} rank(s): {detail}")
            if error is not None:
                raise err from error
            raise err

    def all_gather_ints(self, values: list[int], where: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank)."""
        self.check()
        if self.pg is None:
            return [list(values)]
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        self._waited(self.pg.allgather([out], [t]), where)
        return [o.tolist() for o in out]

    def all_reduce_max(self, values: list[int], where: str) -> list[int]:
        self.check()
        if self.pg is None:
            return [int(v) for v in values]
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # the stubs: RedOpType vs ReduceOp
        self._waited(self.pg.allreduce([t], opts), where)
        return [int(v) for v in t.tolist()]

    def all_gather_bytes(self, data: bytes, where: str) -> list[bytes]:
        """Every rank's ``data`` (any lengths)."""
        if self.pg is None:
            self.check()
            return [bytes(data)]
        sizes = [s[0] for s in self.all_gather_ints([len(data)], where)]
        width = max(1, max(sizes))
        t = torch.zeros(width, dtype=torch.uint8)
        if data:
            t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._waited(self.pg.allgather([out], [t]), where)
        return [bytes(o[:n].numpy().tobytes()) for o, n in zip(out, sizes)]

    def all_gather_json(self, value: Any, where: str) -> list[Any]:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(value, sort_keys=True).encode(), where)]

    def broadcast_bytes(self, data: bytes | None, root: int, where: str) -> bytes:
        """``root``'s ``data`` on every rank."""
        if self.pg is None:
            self.check()
            return bytes(data or b"")
        n = torch.tensor([len(data or b"")], dtype=torch.int64)
        self._broadcast(n, root, where)
        t = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == root and data:
            t[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(t):
            self._broadcast(t, root, where)
        return bytes(t.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, root: int, where: str) -> None:
        self.check()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._waited(self.pg.broadcast([t], opts), where)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        self.check()
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.pg.recv([t], src, tag)

    def wait(self, work: Any, where: str) -> None:
        self._waited(work, where)


__all__ = ["TierCoord", "TierGroup", "TierGroupBroken"]
