"""Where the persist processes of a manager meet: a c10d store that rank 0's persist process
hosts, so that the commit of a handed-over save depends on no trainer, nor on torchrun's agent
(whose store goes when it tears its workers down and exits).

Rank 0's persist process starts the server at its start and writes its address under the
manager's namespace in the job's own store (the only use of that store). The others read it
there at their first save, and again after losing the connection (a new rank-0 persist process
writes a new address). ``Meeting`` is the ``Coordinator`` the persist process's save protocol
uses: it forwards to the coordinator of the current connection.

Every rank but 0 marks each outcome it has read (``seen``); rank 0's process, about to exit,
waits for those marks of its last save (bounded), so its store never goes while another rank
still needs the outcome it published.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardkeeper.core.commit.protocol import Failure, Outcome, RankReport, Report
from shardkeeper.core.commit.terms import SaveTerms
from shardkeeper.core.errors import CoordinatorLostError
from shardkeeper.core.runtime.coordinator import StoreCoordinator
from shardkeeper.core.runtime.store_channel import StoreChannel

log = logging.getLogger(__name__)

#: How long rank 0's process waits at its exit for the other ranks to join and read its last outcome.
SEEN_WAIT_S = 60.0
#: How long another rank's process waits for rank 0's address and its store: bounded, so that a
#: persist process whose rank 0 never came ends within it.
_JOIN = timedelta(seconds=60)


def _reachable_host(job_host: str) -> str:
    """This host's address as the job's store host reaches it (the interface towards it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((job_host, 9))  # no packet is sent: only the route is looked up
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class Meeting:
    """The persist processes' coordinator for rank ``rank`` of ``world_size`` (module doc)."""

    def __init__(
        self, job_store: tuple[str, int], rank: int, world_size: int, namespace: str, group_ranks: int, timeout_s: float
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._ns, self._group_ranks = namespace + "/persist", group_ranks
        self._timeout = timedelta(seconds=max(60.0, timeout_s))
        self._job = StoreChannel(
            dist.TCPStore(job_store[0], job_store[1], is_master=False, wait_for_workers=False, timeout=self._timeout),
            "finding the persist processes' store",
            own=False,
        )
        self._addr = ""
        self._inner: StoreCoordinator | None = None
        self._server: Any = None
        self.raw_store: Any = None  # the store itself, of the current connection (the tiers' group meets on it)
        self._last_seq: int | None = None
        if rank == 0:
            host = _reachable_host(job_store[0])
            self._server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout)
            self._addr = f"{host}:{self._server.port}"
            self.raw_store = self._server
            self._inner = StoreCoordinator.over(self._server, 0, world_size, self._ns, group_ranks)
            self._job.set(self._key, self._addr)

    @property
    def _key(self) -> str:
        return f"{self._ns}/address"

    def current(self) -> StoreCoordinator:
        """The coordinator of the current connection (connecting first when there is none)."""
        if self._inner is None:
            self._job.wait([self._key], _JOIN)
            addr = self._job.get(self._key).decode()
            deadline = time.monotonic() + _JOIN.total_seconds()
            while addr == self._addr and time.monotonic() < deadline:  # the old one's: wait for the new one
                time.sleep(0.1)
                addr = self._job.get(self._key).decode()
            host, _, port = addr.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=_JOIN)
            self._addr, self.raw_store = addr, store
            self._inner = StoreCoordinator.over(store, self.rank, self.world_size, self._ns, self._group_ranks)
            self._inner.mark(-1, "joined")  # rank 0's process keeps its store until every rank joined
        return self._inner

    def lost(self) -> None:
        """The connection failed: the next save connects again (rank 0 keeps its own server)."""
        if self.rank != 0:
            self._inner = None

    def seen(self, seq: int) -> None:
        """This rank has read the outcome of save ``seq`` (rank 0: the save it waits on at exit)."""
        self._last_seq = seq
        if self.rank != 0 and self._inner is not None:
            try:
                self._inner.mark(seq, "seen")
            except CoordinatorLostError:
                pass

    def before_exit(self) -> None:
        """Rank 0: wait (bounded) until every other rank has joined (a manager closed before
        its first save: they still connect once) and read the last outcome."""
        if self.rank != 0 or self._inner is None:
            return
        deadline = time.monotonic() + SEEN_WAIT_S
        waits = [(-1, "joined")] + ([(self._last_seq, "seen")] if self._last_seq is not None else [])
        for seq, name in waits:
            while time.monotonic() < deadline:
                try:
                    if self._inner.mark(seq, name, 0) >= self.world_size - 1:
                        break
                except CoordinatorLostError:
                    return
                time.sleep(0.05)
            else:
                log.warning("persist process of rank 0: not every rank %s (save %d) before its exit", name, seq)
                return

    # -- the Coordinator protocol -------------------------------------------------------------
    def report(self, seq: int, report: Report, *, terms: SaveTerms | None = None) -> None:
        self.current().report(seq, report, terms=terms)

    def leads(self) -> bool:
        return self.current().leads()

    def collect_group(
        self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure | None:
        return self.current().collect_group(seq, timeout_s, step=step, terms=terms)

    def collect(
        self, seq: int, own: RankReport, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure:
        return self.current().collect(seq, own, timeout_s, step=step, terms=terms)

    def publish(self, seq: int, outcome: Outcome, *, terms: SaveTerms | None = None) -> None:
        self.current().publish(seq, outcome, terms=terms)

    def outcome(self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None) -> Outcome:
        return self.current().outcome(seq, timeout_s, step=step, terms=terms)

    def agree_int(self, value: int, op: str) -> int:
        raise NotImplementedError("a persist process never runs a collective")

    def agree_text(self, text: str) -> str:
        raise NotImplementedError("a persist process never runs a collective")


__all__ = ["Meeting"]
