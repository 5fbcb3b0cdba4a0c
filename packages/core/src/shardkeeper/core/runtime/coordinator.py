"""Rank coordination for the commit, without collectives on the training process group.

The background thread of every rank *reports* its chunk records (or its failure) to the
coordinator (rank 0) through the process group's c10d store, and waits for the *outcome*
the coordinator publishes there (``core/commit/protocol.py``: the order, and the records as
JSON; ``runtime/coordination.py``: the ``Coordinator`` protocol, which this module and
``local_coordinator.py`` implement). Store operations are point-to-point requests to the store server: safe from a background
thread, and independent of NCCL/gloo streams.

Collectives are used only on the caller's thread: once when a manager is created (to agree
on a namespace) and during restore (to agree on the step and on success).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core.commit.protocol import (
    COORDINATOR,
    Failure,
    Outcome,
    RankReport,
    Report,
    malformed,
    report_from_json,
)
from shardkeeper.core.commit.terms import MEMBER, SaveTerms, mismatch
from shardkeeper.core.errors import CheckpointTimeoutError, StoreTimeout
from shardkeeper.core.format.columns import no_gc
from shardkeeper.core.format.jsonvalue import loads_exact
from shardkeeper.core.runtime.coordination import Coordinator
from shardkeeper.core.runtime.local_coordinator import LocalCoordinator
from shardkeeper.core.runtime.store_channel import StoreChannel, rank_lost
from shardkeeper.core.state import _torch_compat as tc


def _collective_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class StoreCoordinator:
    """Ranks of a torch.distributed process group, coordinated through its c10d store."""

    group: Any
    rank: int
    world_size: int
    namespace: str
    _reported: int | None = field(default=None, init=False)  # the seq of this rank's last report
    group_ranks: int = 128  # ranks per group leader when the world is larger (group commit)
    share_group: Any = None  # restore's own gloo group (``restore/share.py``), made at first use
    _failed_seqs: list[int] = field(default_factory=list, init=False)  # failed saves whose keys may linger
    _channel: StoreChannel | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, group: Any = None) -> StoreCoordinator:
        """Collective (caller's thread): agree on a fresh namespace for this manager's keys."""
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        device = _collective_device(group)
        token = torch.frombuffer(bytearray(secrets.token_bytes(8)), dtype=torch.uint8).to(device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(token, src=src, group=group)
        ns = "shardkeeper/" + bytes(token.cpu().tolist()).hex()
        coord = cls(group, rank, world, ns)
        coord._channel = StoreChannel(tc.group_store(group), "a save's reports and outcome")  # on the caller's thread
        return coord

    @classmethod
    def over(cls, store: Any, rank: int, world_size: int, namespace: str, group_ranks: int) -> StoreCoordinator:
        """Not a collective: a coordinator of ``rank`` whose keys live under ``namespace`` of
        ``store`` (a persist process's own connection to the job's store server)."""
        coord = cls(None, rank, world_size, namespace, group_ranks=group_ranks)
        coord._channel = StoreChannel(store, "a save's reports and outcome", own=False)
        return coord

    def mark(self, seq: int, name: str, amount: int = 1) -> int:
        """Count ``amount`` into the counter ``name`` of save ``seq``; its new value (0: read it)."""
        return int(self._store.add(self._key(seq, name), amount))

    @property
    def _store(self) -> Any:
        """The save path's own connection to the group's store (``store_channel.py``): its
        long waits block neither the training job's use of the store nor an upload's."""
        if self._channel is None:
            self._channel = StoreChannel(tc.group_store(self.group), "a save's reports and outcome")
        return self._channel

    @property
    def save_store(self) -> Any:
        """The save path's own connection to the group's store (what the tiers' coordinates
        of a persist process use, ``tiers/process_writer.py``)."""
        return self._store

    def _key(self, seq: int, name: str) -> str:
        return f"{self.namespace}/{seq}/{name}"

    def report(self, seq: int, report: Report, *, terms: SaveTerms | None = None) -> None:
        """Set this rank's report (with the save's ``terms``), then count it in; the last rank to count in, or a failing
        rank (which also names itself), wakes the coordinator. This rank's previous report is
        deleted here: the coordinator read it before it published the outcome this rank waited
        for, so the coordinator never spends a round trip per rank on deleting."""
        store = self._store
        if self._reported is not None:
            store.delete_key(self._key(self._reported, f"report/{self.rank}"))
        self._reported = seq
        doc = report.to_json()
        if terms is not None:
            doc[MEMBER] = terms.to_json()
        store.set(self._key(seq, f"report/{self.rank}"), json.dumps(doc))
        leader = self._leader_of(self.rank)
        if isinstance(report, Failure):
            store.set(self._key(seq, "failed"), str(self.rank))
            store.set(self._key(seq, "wake"), "1")
            if self._paged and leader != self.rank:  # its leader, waiting for its group, hears it at once
                store.set(self._key(seq, f"gwake/{leader}"), "1")
        elif self._paged and leader != self.rank:  # to its group's leader
            if store.add(self._key(seq, f"gcount/{leader}"), 1) == self._size_of(leader) - 1:
                store.set(self._key(seq, f"gwake/{leader}"), "1")
        elif store.add(self._key(seq, "count"), 1) == len(self._leaders) - 1:
            store.set(self._key(seq, "wake"), "1")

    @property
    def _paged(self) -> bool:
        return self.world_size > self.group_ranks

    def _leader_of(self, rank: int) -> int:
        """The leader of ``rank``'s group in a group commit. The coordinator (rank 0) is a group
        of its own, so that it folds no other rank's report and its work does not grow with the
        world: ranks 1, 2, ... form groups of ``group_ranks``, each led by its first rank."""
        return 0 if rank == 0 else rank - (rank - 1) % self.group_ranks

    @property
    def _leaders(self) -> range | list[int]:
        """The ranks the coordinator hears from: every rank, or the group leaders."""
        if not self._paged:
            return range(self.world_size)
        return [0, *range(1, self.world_size, self.group_ranks)]

    def _size_of(self, leader: int) -> int:
        return 1 if leader == 0 else min(self.group_ranks, self.world_size - leader)

    def leads(self) -> bool:
        return self._paged and self._leader_of(self.rank) == self.rank

    def collect_group(
        self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure | None:
        """One blocking wait for the group's wake key (set by its last rank to report, or by
        any failing one), then the group's reports in one ``multi_get``."""
        store, leader = self._store, self.rank
        members = range(leader + 1, leader + self._size_of(leader))
        if not members:
            return []
        wake = self._key(seq, f"gwake/{leader}")
        try:
            store.wait([wake], timedelta(seconds=timeout_s))
        except StoreTimeout:
            missing = [r for r in members if not store.check([self._key(seq, f"report/{r}")])]
            raise CheckpointTimeoutError(
                f"step {step}: ranks {missing[:16]} did not report to their group leader, rank {leader}, within "
                f"{timeout_s:.0f} s (phase: report); a rank died or hangs in its write. Raise commit_timeout_s "
                f"if writes are slow"
            ) from None
        count = self._key(seq, f"gcount/{leader}")
        if store.check([self._key(seq, "failed")]) and store.add(count, 0) < len(members):
            return None  # a failure in its group: the coordinator hears of it from the failing rank
        store.delete_key(wake)
        store.delete_key(count)
        return self._read_reports(seq, list(members), step, terms)

    def collect(
        self, seq: int, own: RankReport, timeout_s: float, *, step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure:
        """A constant number of store round trips, whatever the world size: one blocking wait
        for the wake key, the count, then every report in one ``multi_get`` (or the failing
        rank's report alone). Only a timeout looks at the ranks one by one, to name them."""
        store = self._store
        others = [r for r in self._leaders if r != self.rank]
        if self._paged:  # leaders time out on a missing rank first, and say which
            timeout_s += min(timeout_s, 30.0)
        try:
            store.wait([self._key(seq, "wake")], timedelta(seconds=timeout_s))
        except StoreTimeout:
            missing = [r for r in others if not store.check([self._key(seq, f"report/{r}")])]
            who = "group leaders" if self._paged else "ranks"
            raise CheckpointTimeoutError(
                f"step {step}: {who} {missing} did not report within {timeout_s:.0f} s "
                f"(phase: report); a rank died or hangs in its write. Raise commit_timeout_s "
                f"if writes are slow"
            ) from None
        if store.add(self._key(seq, "count"), 0) < len(others):  # woken by a failure
            return self._failed_report(seq, step)
        got = self._read_reports(seq, others, step, terms)
        if isinstance(got, Failure):
            return got
        return [own, *got]

    def _failed_report(self, seq: int, step: int) -> Failure:
        store = self._store
        r = int(store.get(self._key(seq, "failed")))
        key = self._key(seq, f"report/{r}")
        report = _read_report(store.get(key), rank=r, where=f"step {step}: the report of rank {r} ({key})")
        if isinstance(report, Failure):
            return report
        raise malformed(f"step {step}: the report of rank {r} ({key})", "it names a failure but reports success")

    def _read_reports(
        self, seq: int, ranks: list[int], step: int, terms: SaveTerms | None = None
    ) -> list[RankReport] | Failure:
        """The reports of ``ranks`` in one round trip, parsed, or the first failure among them.
        Raises ``SaveTermsMismatch`` when one was sent on other ``terms``."""
        store = self._store
        keys = [self._key(seq, f"report/{r}") for r in ranks]
        got: list[RankReport] = []
        sent: dict[int, SaveTerms | None] = {}
        with no_gc():  # a report makes a hundred small objects, none in a cycle: 16,384 reports
            # otherwise trigger full collections that cost as much as parsing them
            for r, k, data in zip(ranks, keys, _multi_get(store, keys)):
                where = f"step {step}: the report of rank {r} ({k})"
                doc = _parse(data, where)
                if terms is not None and isinstance(doc, dict):
                    sent[r] = SaveTerms.of(doc.get(MEMBER))
                report = report_from_json(doc, rank=r, where=where)
                if isinstance(report, Failure):
                    return report
                got.append(report)
        wrong = mismatch(terms, self.rank, sent) if terms is not None else None
        if wrong is not None:
            raise wrong
        return got

    def publish(self, seq: int, outcome: Outcome, *, terms: SaveTerms | None = None) -> None:
        """Set the outcome (with the save's ``terms``), then delete this save's keys. After a failure, ranks that had not
        reported yet (or a leader whose group timed out) can still write theirs: such a save's
        keys are deleted again after the next committed save, when every rank has passed it
        (one save in flight per manager), so that a long job's failures do not fill the store."""
        store = self._store
        doc = outcome.to_json()
        if terms is not None:
            doc[MEMBER] = terms.to_json()
        store.set(self._key(seq, "outcome"), json.dumps(doc))
        for name in self._names(outcome.ok):
            store.delete_key(self._key(seq, name))
        if not outcome.ok:
            self._failed_seqs.append(seq)
            return
        for failed in self._failed_seqs:
            for name in [*self._names(False), "outcome", "acks"]:
                store.delete_key(self._key(failed, name))
        self._failed_seqs.clear()

    def _names(self, ok: bool) -> list[str]:
        """A save's keys that are not a rank's own report."""
        names = ["count", "wake", "failed"]
        if self._paged and not ok:  # a failed group's leader left its group's keys
            names += [f"g{k}/{leader}" for leader in self._leaders[1:] for k in ("wake", "count")]
        return names

    def outcome(self, seq: int, timeout_s: float, *, step: int, terms: SaveTerms | None = None) -> Outcome:
        store = self._store
        key = self._key(seq, "outcome")
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except StoreTimeout as e:
            raise CheckpointTimeoutError(
                f"step {step}, rank {self.rank}: no commit outcome from the coordinator (rank 0) "
                f"within {timeout_s:.0f} s; it died or hangs. The checkpoint was not committed"
            ) from e
        where = f"step {step}, rank {self.rank}: the outcome ({key})"
        doc = _parse(store.get(key), where, json.loads)
        out = Outcome.from_json(doc, where=where)
        if store.add(self._key(seq, "acks"), 1) == self.world_size - 1:  # all but rank 0
            store.delete_key(key)
            store.delete_key(self._key(seq, "acks"))
        theirs = SaveTerms.of(doc.get(MEMBER)) if isinstance(doc, dict) else None
        if out.ok and terms is not None and theirs is not None and theirs != terms:
            wrong = mismatch(theirs, COORDINATOR, {self.rank: terms})
            assert wrong is not None
            raise wrong  # a commit of another save than this rank's never resolves its handle
        return out

    def agree_int(self, value: int, op: str) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device(self.group))
        try:
            if op == "bcast":
                src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                dist.broadcast(t, src=src, group=self.group)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:  # gloo's closed connection (DistBackendError, DistNetworkError)
            raise rank_lost(self.rank, f"agreeing on a value ({op})", e) from e
        return int(t.item())

    def agree_text(self, text: str) -> str:
        # Never raises before the collectives (a path's undecodable byte, a lone surrogate):
        # a rank that raised here would leave the others waiting in a broadcast.
        data = text.encode(errors="backslashreplace") if self.rank == 0 else b""
        n = self.agree_int(len(data), "bcast")
        if not n:
            return ""
        buf = bytearray(data) if self.rank == 0 else bytearray(n)
        t = torch.frombuffer(buf, dtype=torch.uint8).to(_collective_device(self.group))
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        try:
            dist.broadcast(t, src=src, group=self.group)
        except RuntimeError as e:
            raise rank_lost(self.rank, "agreeing on a text", e) from e
        return t.cpu().numpy().tobytes().decode(errors="replace")


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    """Every key's value in one round trip where the store can (``multi_get``), else one each."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError):
        return [store.get(k) for k in keys]


def _parse(data: bytes, where: str, loads: Callable[[bytes], Any] = loads_exact) -> Any:
    """A message of the store as JSON (reports exactly: one with NaN or big integers declares it)."""
    try:
        return loads(data)
    except (ValueError, RecursionError) as e:
        raise malformed(where, f"it is not JSON ({e})") from None


def _read_report(data: bytes, *, rank: int, where: str) -> Report:
    return report_from_json(_parse(data, where), rank=rank, where=where)


def make_coordinator(
    group: Any = None, *, group_ranks: int = 128, tiered: bool = False, persist: bool = False
) -> Coordinator:
    """The coordinator for ``group``: ``"local"`` is this process alone, even inside an
    initialised process group (a lone reader: ``load()``, ``manifest()``); otherwise the
    group's ranks (default: the world) when there are several, else this process.
    ``tiered``: this rank's manager has a local tier; ``persist``: its saves are written by a
    persist process (``writer="process"``). The ranks must agree on both and on
    ``group_ranks`` (checked in the same two collectives: a rank without a local tier would
    never join the tiers' collectives, one without a persist process never meet the others)."""
    if isinstance(group, str):
        if group != "local":
            raise ValueError(f"process_group must be a torch ProcessGroup, None or 'local', not {group!r}")
        return LocalCoordinator()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        coord = StoreCoordinator.create(group)
        mine = 4 * group_ranks + 2 * int(persist) + int(tiered)
        lo, hi = coord.agree_int(mine, "min"), coord.agree_int(mine, "max")
        if lo // 4 == hi // 4 and (lo ^ hi) & 1:
            raise ValueError(
                f"rank {coord.rank}: some ranks passed local= (a local tier) and others did not "
                f"({'this one did' if tiered else 'this one did not'}); every rank must pass the same tier options"
            )
        if lo // 4 == hi // 4 and (lo ^ hi) & 2:
            raise ValueError(
                f"rank {coord.rank}: some ranks passed writer='process' and others did not (this one passed "
                f"writer={'process' if persist else 'thread'!r}); every rank must pass the same writer"
            )
        lo, hi = lo // 4, hi // 4
        if lo != hi:  # ranks would wait for leaders that do not lead
            raise ValueError(
                f"rank {coord.rank}: commit_group_ranks differs between the ranks (from {lo} to {hi}); "
                f"every rank must pass the same value"
            )
        coord.group_ranks = group_ranks
        return coord
    return LocalCoordinator()


__all__ = ["Coordinator", "LocalCoordinator", "StoreCoordinator", "make_coordinator"]
