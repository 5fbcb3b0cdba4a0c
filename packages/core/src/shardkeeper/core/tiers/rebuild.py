"""Lost local files rebuilt from parity (``erasure=(k, m)``), before a restore chooses its step.

Every node's leader lists the parity records it holds and the files of its steps
(``placement.listing``); the listings are all-gathered, so every rank plans alike
(``placement.plan``). A data node of a group is lost in a step when one of its files is on no
node at its size. The newest step with a manifest somewhere is taken (``step=``: that one),
with the earlier steps whose files it points at (an incremental save); when every piece of
every group of those steps that lost data nodes keeps k shards, each such group is rebuilt
on its first lost node's leader: piece by piece, k shards stream to it (surviving data
nodes' files first, then parity pieces, each checked against its recorded digest), are
decoded (``erasure.py``) and written as the lost nodes' files. The manifest of the step
restored goes there too, and the rebuilt files are checked against its digests
(``verify_step``); files that fail are removed again. Choosing the step then finds it whole,
and ``make_whole`` copies it on. A step whose rebuild fails is skipped, with a warning: the
next older one is tried, and the restore falls back as without parity.

A file whose every copy fails the manifest's digests (found by a restore's read and judged
by ``repair.py``) is rebuilt the same way (``rebuild_damaged``): its copies count as absent, as if its node's
directory were gone.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, cast

import numpy as np
import torch
import xxhash

from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError
from shardkeeper.core.format.layout import step_dir, writer_rank
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.tiers.erasure import Code
from shardkeeper.core.tiers.losses import lost_beyond_parity, node_names
from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.parity import Concat
from shardkeeper.core.tiers.placement import Job, listing, parity_name, plan
from shardkeeper.core.tiers.transfer import remove_copy
from shardkeeper.core.tiers.wire import TierGroup, TierGroupBroken
from shardkeeper.core.verify.step import verify_step

log = logging.getLogger(__name__)
#: gloo tags of a rebuild's pieces: ``TAG + round * 256 + shard``.
TAG = 1 << 26


def _listings(group: TierGroup, nodes: NodeMap, local: Any, where: str) -> list[dict[str, Any]]:
    """Collective: every node's parity listing (``placement.listing``), in node order."""
    mine, error = None, None
    if nodes.is_leader(group.rank):
        try:
            mine = {**listing(local.raw, local.read), "dir": local.raw.url}
        except Exception as e:  # every rank hears it (agreed below)
            error = e
    group.agree_ok(error, f"{where}: listing the parity")
    got = group.all_gather_json(mine, f"{where}: the parity's listings")
    return [got[nodes.leader(k)] for k in range(len(nodes.nodes))]


def rebuild_lost(
    group: TierGroup, nodes: NodeMap, local: Any, asked: int | None, erasure: tuple[int, int]
) -> tuple[list[str], list[str]]:
    """Collective: the lost files of the newest step (or ``asked``) rebuilt from parity on
    their nodes, verified. Every local failure is agreed on. Returns the files rebuilt
    (root-relative) and, for each newer step that lost more nodes of a group than its parity
    rebuilds, a note naming the step, the group and the lost nodes (``lost_beyond_parity``),
    also logged on rank 0."""
    me = group.rank
    where = f"rank {me}: rebuilding lost files from parity"
    listings = _listings(group, nodes, local, where)
    failed: set[int] = set()
    while True:
        jobs = plan(listings, asked, len(nodes.nodes), failed)
        try:
            for job in jobs:
                _job(group, nodes, local, job, listings, where)
        except TierGroupBroken:
            raise
        except CheckpointError as e:  # (agreed: every rank is here) an older step, or the fallback
            log.warning("rank %d: step %d could not be rebuilt from parity: %s", me, jobs[0].of, e)
            failed.add(jobs[0].of)
            continue
        notes = lost_beyond_parity(listings, nodes, erasure, asked, jobs[0].of if jobs else None)
        for note in notes if me == 0 else ():
            log.warning("%s", note)
        return _rebuilt(jobs), notes


def rebuild_damaged(group: TierGroup, nodes: NodeMap, local: Any, step: int, paths: list[str]) -> list[str]:
    """Collective: ``paths`` (files of ``step`` or of the steps it points at), of which no
    node holds a copy that checks out, rebuilt from parity on their nodes as if lost: every
    node's copy of them counts as absent, the damaged copy on the rebuilt node is replaced,
    and the rebuilt files are verified. Returns the files rebuilt (``paths`` and the other
    files of their nodes' streams); [] when the parity does not cover them or the rebuild
    failed (logged: the restore then judges the step damaged)."""
    me = group.rank
    where = f"rank {me}: rebuilding damaged files from parity"
    listings = _listings(group, nodes, local, where)
    gone = set(paths)
    for lst in listings:
        for files in lst["files"].values():
            for p in gone.intersection(files):
                del files[p]
    jobs = plan(listings, step, len(nodes.nodes))
    if not jobs or not gone <= set(_rebuilt(jobs)):
        log.warning(
            "rank %d: step %d: no copy of %s checks out, and the parity on the nodes does not cover %s",
            me,
            step,
            ", ".join(sorted(gone)[:4]) + (" ..." if len(gone) > 4 else ""),
            "it" if len(gone) == 1 else "them",
        )
        return []
    try:
        for job in jobs:
            _job(group, nodes, local, job, listings, where)
    except TierGroupBroken:
        raise
    except CheckpointError as e:  # (agreed: every rank is here)
        log.warning("rank %d: step %d: the damaged files could not be rebuilt from parity: %s", me, step, e)
        return []
    return _rebuilt(jobs)


def _rebuilt(jobs: list[Job]) -> list[str]:
    """The files ``jobs`` write: their lost nodes' files (every rank alike)."""
    return sorted({str(p) for job in jobs for i in job.lost for p, _ in job.record["members"][i]})


def _job(group: TierGroup, nodes: NodeMap, local: Any, job: Job, listings: list[Any], where: str) -> None:
    """Collective: one group rebuilt on its target (``_run``); a failure raised on every rank."""
    me = group.rank
    _manifest_to(group, nodes, local, job, listings)
    error = None
    try:
        _run(group, nodes, local, job, listings)
    except Exception as e:  # this rank's own failure, or a sender's: agreed below
        group.check()
        error = e
    group.agree_ok(error, f"step {job.step}, {where}")
    if me == nodes.leader(job.target):
        shown = ", ".join(str(job.record["nodes"][i]) for i in job.lost)
        log.warning("rank %d: step %d: the files of node(s) %s rebuilt here from parity", me, job.step, shown)


def _manifest_to(group: TierGroup, nodes: NodeMap, local: Any, job: Job, listings: list[dict[str, Any]]) -> None:
    """The manifest of ``job.of`` (the step restored) put on the target node when it lacks it
    (one broadcast)."""
    holders = [n for n, lst in enumerate(listings) if job.of in lst["manifests"]]
    if job.target in holders:
        return
    me, src = group.rank, nodes.leader(holders[0])
    data, error = None, None
    if me == src:
        try:
            data = local.raw.read_bytes(manifest_path(job.of))
        except Exception as e:
            error = e
    data = group.broadcast_bytes(data, src, f"step {job.of}, rank {me}: the manifest for the rebuilt node")
    if me == nodes.leader(job.target) and error is None and data:
        try:
            if local.raw.exists(manifest_path(job.of)):
                local.storage.delete(manifest_path(job.of))  # a copy that does not validate
            local.raw.put_if_absent(manifest_path(job.of), data)
        except Exception as e:
            error = e
    group.agree_ok(error, f"step {job.of}, rank {me}: recording the manifest on the rebuilt node")


def _read(local: Any, rec: dict[str, Any], shard: int, at: int, buf: np.ndarray) -> None:
    """``buf`` from ``shard`` of ``rec``'s group at ``at``: a data node's files as one stream
    (zeros past its length), or the pieces this node holds of a parity shard."""
    if shard < rec["k"]:
        files, length = [(p, int(s)) for p, s in rec["members"][shard]], rec["lengths"][shard]
    else:
        path = parity_name(rec["step"], rec["group"], shard - rec["k"])
        files = [(path, local.raw.size(path))]
        length = files[0][1]
    got = max(0, min(len(buf), length - at))
    if got:
        Concat(local.raw, files).read(at, memoryview(cast("Any", buf[:got])))
    buf[got:] = 0


def _run(group: TierGroup, nodes: NodeMap, local: Any, job: Job, listings: list[Any]) -> None:
    """This rank's part of ``job``: send the pieces it holds to the target's leader, or (that
    leader) receive k shards of each piece, decode and write the lost nodes' files, verify
    (``listings``: the nodes' directories, which a failure names).
    A rank whose read, check or write fails keeps taking part in every round (sending zeros,
    dropping what arrives), so that no peer waits on it, and raises at the end."""
    me, rec = group.rank, job.record
    named = partial(_named, nodes, listings, job)
    k, total, size = rec["k"], rec["length"], rec["piece_bytes"]
    target = nodes.leader(job.target)
    failed: list[BaseException] = []
    problem = _members_problem(job, nodes) if me == target else None
    if problem is not None:
        failed.append(CorruptCheckpointError(problem))
    out = _Out(local.raw, rec, job.lost) if me == target and problem is None else None
    try:
        for p in out.paths if out is not None else ():
            if local.raw.exists(p):
                remove_copy(local.storage, p)  # (a copy cut short: replaced)
    except Exception as e:
        failed.append(e)
    bufs = {i: np.zeros(min(size, total), dtype=np.uint8) for i in range(k + rec["m"])}
    code = Code(k, rec["m"])
    try:
        for r, sources in enumerate(job.rounds):
            n = min(size, total - r * size)
            works = []
            for i, (node, at) in sources.items():
                src = nodes.leader(node)
                if src == me:
                    _attempt(failed, _read, local, rec, i, at, bufs[i][:n])
                    if me != target:
                        works.append((group.send(torch.from_numpy(bufs[i][:n]), target, TAG + r * 256 + i), target))
                elif me == target:
                    works.append((group.recv(torch.from_numpy(bufs[i][:n]), src, TAG + r * 256 + i), src))
            for work, peer in works:
                group.wait(work, f"step {job.step}, rank {me}: the rebuild's pieces (with rank {peer})")
            if out is not None:
                _attempt(failed, _decode, job, code, r, {i: bufs[i][:n] for i in sources}, out, named)
        if out is not None and not failed:
            out.close()
        if failed:
            raise failed[0]
    except BaseException:
        if out is not None:
            out.abort()
        raise
    if out is not None:
        used = sorted({(i, node) for sources in job.rounds for i, (node, _) in sources.items()})
        _verify(local, job.of, out.paths, "; ".join(named(i, node) for i, node in used))


def _members_problem(job: Job, nodes: NodeMap) -> str | None:
    """Why the record's files of a lost node may not be written, or None: each must lie in
    the rebuilt step's directory and be named for one of that node's ranks, so that a
    damaged or forged record never writes over another step's or another node's file."""
    rec, top = job.record, step_dir(job.step)
    for i in job.lost:
        node = rec["nodes"][i] % len(nodes.nodes)
        ranks = set(nodes.nodes[node])
        for path, _ in rec["members"][i]:
            parts = str(path).split("/")
            if parts[0] != top or len(parts) < 2 or ".." in parts or "" in parts or writer_rank(path) not in ranks:
                return (
                    f"step {job.step}: the parity record of group {rec.get('group')} names {str(path)[:200]!r} as a "
                    f"file of node {node}, which is not a file of that node's ranks {sorted(ranks)} in {top}/: the "
                    f"record is damaged (or forged), so nothing is rebuilt from it and the restore goes on as without "
                    f"this parity (an older step, then the persistent root)"
                )
    return None


def _attempt(failed: list[BaseException], fn: Any, *args: Any) -> None:
    """``fn(*args)`` unless an earlier step of this rank failed; its failure kept in ``failed``."""
    if failed:
        return
    try:
        fn(*args)
    except Exception as e:  # raised after the last round, which the peers wait on
        failed.append(e)


def _named(nodes: NodeMap, listings: list[Any], job: Job, shard: int, node: int) -> str:
    """Shard ``shard`` of ``job``'s group as ``node`` holds it, for a message: the node (its
    index, ranks and directory) and its files (a data node's, or the parity file)."""
    rec = job.record
    if shard >= rec["k"]:
        files = [parity_name(job.step, rec["group"], shard - rec["k"])]
    else:
        files = [str(p) for p, _ in rec["members"][shard]]
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return f"{node_names(nodes, listings, [node])}: {', '.join(files[:3])}{more}"


def _decode(job: Job, code: Code, r: int, blocks: dict[int, np.ndarray], out: _Out, named: Any) -> None:
    """Piece ``r`` of the lost data shards from ``blocks``, after checking each parity piece
    (``named``: a shard and its node named for the error)."""
    rec = job.record
    k, off = rec["k"], r * rec["piece_bytes"]
    for i, block in blocks.items():
        if i >= k and xxhash.xxh3_128_hexdigest(memoryview(cast("Any", block))) != job.digests[(i - k, r)]:
            node, shown = job.rounds[r][i][0], named(i, job.rounds[r][i][0])
            raise CheckpointError(
                f"step {job.step}: piece {r} of parity shard {i - k} of group {rec['group']}, held by "
                f"{shown.split(': ', 1)[0]} in {shown.split(': ', 1)[1]}, fails its recorded digest: that parity "
                f"file (or its record) on node {node} is damaged; nothing rebuilt from it"
            )
    for i, block in code.decode(blocks, job.lost).items():
        out.write(i, block[: max(0, min(len(block), rec["lengths"][i] - off))])


class _Out:
    """The lost nodes' files written from their decoded streams, each file in turn."""

    def __init__(self, storage: Storage, rec: dict[str, Any], lost: list[int]) -> None:
        self.storage = storage
        self.files = {i: [(p, int(s)) for p, s in rec["members"][i]] for i in lost}
        self.at = {i: (0, 0) for i in lost}  # (file index, bytes written into it)
        self.writers: dict[str, Writer] = {}
        self.paths = [p for i in lost for p, _ in self.files[i]]

    def write(self, i: int, data: np.ndarray) -> None:
        pos = 0
        while pos < len(data):
            f, done = self.at[i]
            path, size = self.files[i][f]
            w = self.writers.get(path)
            if w is None:
                w = self.writers[path] = self.storage.open_writer(path)
            n = min(size - done, len(data) - pos)
            if n:
                w.write(memoryview(cast("Any", data[pos : pos + n])))
            pos += n
            self.at[i] = (f, done + n) if done + n < size else (f + 1, 0)

    def close(self) -> None:
        for files in self.files.values():
            for path, size in files:
                if size == 0 and path not in self.writers:
                    self.writers[path] = self.storage.open_writer(path)
        for w in self.writers.values():
            w.close()
        dirs = {p.rsplit("/", 1)[0] for p in self.paths}
        for d in sorted(dirs, key=lambda d: -d.count("/")):
            self.storage.sync_dir(d)
        for d in {d.split("/", 1)[0] for d in dirs} | {""}:
            self.storage.sync_dir(d)

    def abort(self) -> None:
        for w in self.writers.values():
            try:
                w.abort()
            except Exception:  # already failing: the first error is the one raised
                pass


def _verify(local: Any, step: int, paths: list[str], used: str) -> None:
    """The rebuilt files checked against the manifest's digests; removed when they fail
    (the error names the files ``used`` to decode them: one of those is damaged)."""
    report = verify_step(local.read, step, files=paths)
    if report.problems:
        for p in paths:
            if local.raw.exists(p):
                remove_copy(local.storage, p)
        raise CheckpointError(
            f"step {step}: the files rebuilt from parity on {local.raw.url} fail the manifest's digests "
            f"({'; '.join(str(q) for q in report.problems[:3])}); removed. They were decoded from these files, one "
            f"of which may be damaged: {used} (a data file changed since its save, or parity whose record was "
            f"forged). The step falls back"
        )


__all__ = ["rebuild_damaged", "rebuild_lost"]
