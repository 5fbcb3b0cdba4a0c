"""A ``CheckpointManager``'s two tiers: the state and steps its tier strategy (``two_tiers.py``)
calls in each save and the tiered restore (``restore.py``) in each restore.

Saves write each rank's files into its node's own directory (``local=``); before reporting,
every rank sends them to its peers (``replicas``) and takes theirs, so the coordinator's
commit (into its node's directory) stands for files and replicas on disk; each node's files
are checked on their node (a rank by its write and its received replicas, the coordinator for
its own node), since no node can see another's disk. The commit is then recorded on every
node (``record.py``), retention runs per node (``local_keep``), and every ``persist_every``
steps the step is uploaded to the persistent root (``persist.py``). With uploads on, the
coordinator claims each step on the persistent root before its local commit (``commit/claim.py``),
so a second writer of the step fails at its save, not in an upload. Restore agrees on the
tier and step (``choose.py``), makes every node's copy of a local step whole from its peers,
and reads it like any root; from the persistent tier it restores as a plain manager would.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from shardkeeper.core.codec.crypto import EncryptedStorage
from shardkeeper.core.codec.crypto_format import root_identity
from shardkeeper.core.codec.keys import key_provider
from shardkeeper.core.commit.claim import Claims, Writer
from shardkeeper.core.commit.committed import manifest_steps
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import parse_step_dir, step_dir, writer_rank
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.lifecycle.retention import DeleteOnly, RetentionPolicy, apply_retention
from shardkeeper.core.runtime.context import Encryption
from shardkeeper.core.save.hooks import Committed
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.storage.retry import RetryPolicy, with_retries
from shardkeeper.core.tiers.choose import LOCAL, PERSISTENT, Choice, choose, make_whole, required_files
from shardkeeper.core.tiers.drop import drop_step
from shardkeeper.core.tiers.mend import Mender
from shardkeeper.core.tiers.nodes import NodeMap, discover, node_token
from shardkeeper.core.tiers.parity import encode_step
from shardkeeper.core.tiers.persist import Persister
from shardkeeper.core.tiers.placement import arrange, pointed_at, prune
from shardkeeper.core.tiers.rebuild import rebuild_lost
from shardkeeper.core.tiers.record import Recorder
from shardkeeper.core.tiers.repair import Repair, repair
from shardkeeper.core.tiers.tee import Tee
from shardkeeper.core.tiers.transfer import Move, move_files
from shardkeeper.core.tiers.wire import TierCoord, TierGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opened:
    """One tier's root: ``raw`` without encryption (files are copied as they are), ``storage``
    as saves write it, ``read`` the authenticated view manifests are read through."""

    raw: Storage
    storage: Storage
    read: Storage
    encryption: Encryption | None
    tee: Tee | None = None  # the local tier's: what a save wrote, until its replicas are sent


def open_tier(
    root: Any, storage_options: Mapping[str, Any] | None, retry: RetryPolicy, encryption: Any, bound_to: str | None
) -> Opened:
    """Like ``context.open_root``, keeping the unencrypted storage too."""
    raw = with_retries(open_storage(root, **dict(storage_options or {})), retry)
    keys = key_provider(encryption)
    if keys is None:
        return Opened(raw, raw, raw, None)
    enc = EncryptedStorage(raw, keys, root=bound_to)
    return Opened(raw, enc, enc.authenticated(), Encryption(keys, enc.binding))


class Tiering:
    """The tiers of one manager (made when it opens, a collective of its ranks)."""

    def __init__(
        self,
        coord: Any,
        *,
        local: Opened,
        persistent: Opened,
        persist_every: int | None,
        replicas: int,
        local_keep: int | None,
        erasure: tuple[int, int] | None = None,
        retention: RetentionPolicy,
        catalog: str | None,
        io: Any,
        timeout_s: float,
    ) -> None:
        coord = TierCoord.of(coord)
        self.coord, self.local, self.persistent = coord, local, persistent
        self.group = TierGroup(coord, timeout_s)
        options = {"replicas": replicas, "persist_every": persist_every, "local_keep": local_keep, "erasure": erasure}
        self.nodes: NodeMap = discover(self.group, local.raw, persistent.raw.url, options)
        self.erasure = erasure
        if erasure is not None:
            arrange(len(self.nodes.nodes), *erasure)  # (too few nodes: the same ValueError on every rank)
        self.replicas = min(replicas, len(self.nodes.nodes) - 1)
        if self.replicas < replicas:
            warnings.warn(
                f"replicas={replicas} asked, but the job's ranks share {len(self.nodes.nodes)} local director"
                f"{'y' if len(self.nodes.nodes) == 1 else 'ies'} (nodes): {self.replicas} replica(s) per rank; a "
                f"lost node loses what only it held since the last persisted step",
                stacklevel=5,  # the caller of CheckpointManager() (strategy.make_strategy made these)
            )
        self.local_keep = local_keep
        if local.tee is not None:
            local.tee.recording = self.replicas > 0
        self.recorder = Recorder(coord, self.nodes, timeout_s)
        listed, error = [], None
        try:
            listed = manifest_steps(persistent.raw) if coord.rank == 0 else []
        except Exception as e:
            error = e
        self.group.agree_ok(error, f"rank {coord.rank}: listing the persistent root {persistent.raw.url}")
        newest = self.group.all_reduce_max([listed[-1] if listed else -1], "the persistent tier's newest step")[0]
        here = root_identity(local.raw.url)  # the directory itself: a copy elsewhere is another writer
        writer = Writer.new(here, node_token(local.raw)) if coord.rank == 0 and persist_every else None
        self.claims = Claims(persistent.raw, writer)
        self.persister = Persister(
            coord,
            persist_every,
            local=local.raw,
            local_read=local.read,
            storage=persistent.storage,
            raw=persistent.raw,
            retention=retention,
            catalog=catalog,
            io=io,
            timeout_s=timeout_s,
            newest=None if newest < 0 else newest,
            claims=self.claims,
        )
        self.last_choice: Choice | None = None
        self.last_received: tuple[int, int] = (0, 0)
        self.mend = Mender(self.group, self.nodes, local, erasure)  # damaged files rebuilt from parity

    @property
    def rank(self) -> int:
        return int(self.coord.rank)

    # -- save --------------------------------------------------------------------------------
    def replicate(self, step: int, files: Mapping[str, int] | None) -> None:
        """Every rank, once per save (``files``: root-relative path -> size this rank wrote;
        None when it failed or refused): send them to its peers, take theirs, and check that
        its own are there at their size."""
        raw: dict[str, int] | None = None
        error: BaseException | None = None
        if files is not None:
            try:
                for path, size in files.items():
                    if self.local.storage.size(path) != size:
                        raise OSError(
                            f"step {step}, rank {self.rank}: {self.local.raw.describe(path)} is not the {size} bytes "
                            f"written (something removed or truncated it)"
                        )
                raw = {path: self.local.raw.size(path) for path in files}  # as stored: encrypted files are larger
            except Exception as e:  # raised after the exchange, which its peers wait on
                error, raw = e, None
        listed = self.group.all_gather_json(
            sorted(raw.items()) if raw is not None else None, f"step {step}, rank {self.rank}: the replicas' files"
        )
        plan = []
        for src, own in enumerate(listed):
            for dst in self.nodes.targets(src, self.replicas) if own is not None else ():
                plan += [Move(path, size, src, dst) for path, size in own]
        try:
            move_files(self.group, self.local.raw, plan, f"step {step}, rank {self.rank}: the peer replicas")
            if self.erasure is not None:
                encode_step(self.group, self.nodes, self.local.raw, step, listed, *self.erasure)
        finally:
            if self.local.tee is not None:
                self.local.tee.forget()
        if error is not None:
            raise error

    def before_commit(self, seq: int, step: int, attempt: str, data: bytes) -> None:
        """Coordinator, right before its local commit of ``step`` (nothing may fail between
        that put and the outcome): claim the step on the persistent root (``commit/claim.py``; raises
        ``StepClaimedError`` when another writer holds it), then offer the manifest's bytes
        and whether the step is uploaded to the other nodes (``record.py``)."""
        self.claims.take(step, attempt)
        self.recorder.offer(seq, data, self.persister.due(step))

    def checked_here(self, path: str) -> bool:
        """Coordinator: whether the commit checks ``path`` (root-relative): only files its own
        node wrote (each rank checked its own and its replicas on its node)."""
        rank = writer_rank(path)
        return rank is None or rank in self.nodes.same_node(self.rank)

    def after_commit(self, seq: int, step: int, committed: Committed) -> None:
        """Every rank, the step committed: record it on every node, upload it when due, and
        retain per node (the node's leader)."""
        due = self.recorder.record(seq, step, self.local.storage)  # the coordinator's decision
        manifest, data = committed.manifest, committed.data
        self.persister.keep(step, dict(committed.files), manifest, data)  # what a preemption's ``flush`` uploads
        if due:
            self.persister.submit(step, dict(committed.files), manifest, data, self._my_references(step))
        if self.local_keep is not None and self.nodes.is_leader(self.rank):
            keep = set(self.persister.protected())
            if self.erasure is not None:  # steps pointed at stay whole: their parity needs every node's files
                keep |= pointed_at(self.local.raw, self.local.read)
            policy = RetentionPolicy(keep_last=self.local_keep, keep_steps=frozenset(keep))
            deletion.retain(self.local.storage, policy, None, step)
        if self.erasure is not None and self.nodes.is_leader(self.rank):  # the parity of steps gone from the node
            prune(self.local.raw, {s for s in map(parse_step_dir, self.local.raw.list_dir("")) if s is not None})

    def _my_references(self, step: int) -> list[str]:
        """The files of earlier steps ``step`` points at (an incremental save) that this rank
        uploads: those its rank wrote (by their names, modulo the world size), the others'
        on the coordinator. A manifest that cannot be read uploads none: the persistent
        commit's check of every file then fails, naming the first missing one."""
        try:
            need = required_files(self.local.read, step)
        except CheckpointError as e:
            log.warning("rank %d: step %d's references are not uploaded: %s", self.rank, step, e)
            return []
        world = self.coord.world_size
        out = []
        for path, (_, exact) in need.items():
            writer = writer_rank(path)
            if not exact and (writer % world if writer is not None else 0) == self.rank:
                out.append(path)
        return out

    def flush(self) -> int | None:
        """Every rank alike (a preemption's exit): once the running upload ended, upload the
        newest step committed locally when it is newer than the last one uploaded. Returns
        the step now uploading (or uploaded last), None when nothing ever was."""
        self.persister.join()  # (then every rank has heard the same outcomes)
        kept = self.persister.kept
        if kept is not None and (self.persister.last_step is None or kept[0] > self.persister.last_step):
            self.persister.submit(*kept, self._my_references(kept[0]))
        return self.persister.last_step

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        """Every rank alike (a preemption's exit): ``flush`` once the running upload ended,
        all within ``timeout_s``. Returns the newest step committed locally (None: none) and
        whether it is uploaded and committed to the persistent root by now."""
        p, deadline = self.persister, time.monotonic() + timeout_s
        kept = p.kept  # (named first: the flush may start its upload)
        step = kept[0] if kept is not None else None
        if p.wait_for(timeout_s):  # (one still running past the deadline: not uploaded in time)
            self.flush()
            p.wait_for(deadline - time.monotonic())
        return step, step is not None and step in p.persisted

    # -- restore -----------------------------------------------------------------------------
    def choose(self, asked: int | None) -> Choice:
        """Collective: the tier and step to restore; a local one made whole on every node.
        The running upload is waited for first (its failure stays for ``wait_persisted``)."""
        self.persister.join()
        rebuilt: list[str] = []  # the lost nodes' files rebuilt
        lost: list[str] = []  # the steps newer than the one rebuilt that lost more nodes than parity rebuilds
        if self.erasure is not None:  # lost nodes' files of the newest step, from parity first
            rebuilt, lost = rebuild_lost(self.group, self.nodes, self.local, asked, self.erasure)
        self.mend.start(rebuilt)
        c = choose(self.group, self.nodes, self.local, self.persistent.raw, asked)
        c.lost_beyond_parity = lost
        self.last_choice = c
        if c.tier == LOCAL:
            assert c.step is not None
            self.make_whole(c, c.step)
        elif c.tier == PERSISTENT:
            log.info("rank %d: restoring from the persistent tier %s", self.rank, self.persistent.storage.url)
        return c

    def take_over(self, restored: int | None) -> None:
        """Coordinator, after restoring the newest step (None: none was found): the step
        claims above it become this job's (``Claims.take_over``)."""
        persisted = self.last_choice.persisted if self.last_choice is not None else []
        self.claims.take_over(restored, persisted)

    def forget_persisted(self, quarantined: list[int], uploads: Any = None) -> None:
        """Every rank alike, after a restore quarantined ``quarantined`` on the persistent root:
        the newest step persisted there is the newest left, so that a save of one of those
        steps is due for upload again (``persist_every`` counts from there). ``uploads``: where
        the uploads run when not here (``writer="process"``: the persist process's, told over
        its channel), told the same."""
        if not quarantined or self.last_choice is None:
            return
        left = [s for s in self.last_choice.persisted if s not in quarantined]
        newest = max(left, default=None)
        self.persister.forget_above(newest)
        if uploads is not None and uploads is not self.persister:
            uploads.forget_above(newest)

    def make_whole(self, c: Choice, step: int) -> None:
        self.last_received = make_whole(self.group, self.nodes, self.local, c, step)
        log.info(
            "rank %d: restoring step %d from the local tier (%d files, %d bytes taken from peers)",
            self.rank,
            step,
            *self.last_received,
        )

    def repair(self, step: int, reported: list[str]) -> list[Repair]:
        """Collective: the nodes' damaged copies of the files the ranks ``reported`` (from a
        restore of ``step`` that failed its digests) replaced by good copies from other nodes,
        those with none rebuilt from parity first (``Mender.rebuild``)."""
        return repair(self.group, self.nodes, self.local, step, reported, partial(self.mend.rebuild, step))

    def drop_newer(self, c: Choice, restored: int) -> None:
        """Collective, after restoring the newest: each node's leader removes its local steps
        newer than ``restored`` that no tier holds whole (a save below them would be refused);
        a whole one is never removed. Every rank waits, so no save starts meanwhile."""
        stale = [
            [
                int(k)
                for k, v in lst.items()
                if v["m"] and int(k) > restored and int(k) not in c.local_steps and int(k) not in c.conflicts
            ]
            for lst in c.listings
        ]
        if not any(stale):  # every rank knows every node's listing: nothing to agree on
            return
        error: BaseException | None = None
        if self.nodes.is_leader(self.rank):
            try:
                for s in sorted(stale[self.nodes.node_of(self.rank)]):
                    log.warning(
                        "rank %d: removing local step %d of %s: no tier holds it whole (restored step %d)",
                        self.rank,
                        s,
                        self.local.raw.url,
                        restored,
                    )
                    drop_step(self.local.raw, s)
            except Exception as e:
                error = e
        self.group.agree_ok(error, f"rank {self.rank}: removing local steps no tier holds whole")

    def whole_locally(self, step: int) -> bool:
        """Collective: whether the nodes' directories hold ``step`` whole together (not when
        they hold different manifests of it)."""
        try:
            return step in choose(self.group, self.nodes, self.local, self.persistent.raw, step).local_steps
        except CheckpointError:  # (raised on every rank alike: a conflict, or a listing that failed)
            return False

    def delete_local(self, step: int, *, force: bool = False) -> bool:
        """Collective: every node's leader deletes its copy of ``step`` (``force``: even the
        newest committed one of its directory; else never that one, as ``delete()``); True
        when every node's copy is gone."""
        gone, error = 1, None
        if self.nodes.is_leader(self.rank):
            try:
                if force:
                    drop_step(self.local.raw, step)
                else:
                    apply_retention(self.local.storage, DeleteOnly(frozenset([step])))
                gone = int(step not in manifest_steps(self.local.raw))
            except Exception as e:
                error = e
        self.group.agree_ok(error, f"rank {self.rank}: deleting step {step} from the local tiers")
        return not self.group.all_reduce_max([1 - gone], "whether every node deleted")[0]

    def close(self) -> None:
        self.persister.join()
        self.persister.close()


def local_root(local: Any) -> Storage:
    """The node-local directory (a path: the local tier is a node's own disk or RAM), or a
    ``Storage`` that is not remote (a wrapper over one: the kill -9 campaign's)."""
    if isinstance(local, Storage) and not isinstance(local, (str, os.PathLike)):
        if local.capabilities.remote:
            raise ValueError(f"local={local.url!r}: the local tier is a node's own disk or RAM, not an object store")
        return local
    if (
        not isinstance(local, (str, os.PathLike))
        or "://" in os.fspath(local)
        and not os.fspath(local).startswith("file://")
    ):
        raise ValueError(
            f"local={local!r}: the local tier is a directory on each node's own disk or RAM (e.g. "
            f"'/local_nvme/run' or '/dev/shm/run'), not a URL; the persistent tier is the manager's root"
        )
    text = os.fspath(local)
    return LocalStorage(text[len("file://") :] if text.startswith("file://") else text)


__all__ = ["Opened", "Tiering", "local_root", "open_tier", "step_dir", "writer_rank"]
