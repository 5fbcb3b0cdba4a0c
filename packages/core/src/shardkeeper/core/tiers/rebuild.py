"""Lost local files rebuilt from parity (``erasure=(k, m)``), before a restore chooses its step.

Every node's leader lists the parity records it holds (``parity.py``) and the files of those
steps it has; the listings are all-gathered, so every rank plans alike. A data node of a
group is lost in a step when one of its files is on no node at its size. The newest step
with a manifest somewhere is taken (``step=``: that one); when it lost nodes and every group
that lost some has at most as many as it has parity shards left, each such group is rebuilt
on the first lost node's leader: k shards stream to it piece by piece (surviving data nodes'
files, then parity files, from the leaders that hold them), are decoded (``erasure.py``) and
written as the lost nodes' files. The manifest goes there too, and the rebuilt files are
checked against its digests (``verify_step``); a file that fails is removed again. Choosing
the step then finds it whole, and ``make_whole`` copies it on. A step that cannot be rebuilt
is left as it is: the next older one is tried, and the restore falls back as without parity.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
import torch
import xxhash

from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.tiers.erasure import PIECE_BYTES, Code
from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.parity import Concat
from shardkeeper.core.tiers.placement import Job, listing, parity_name, plan
from shardkeeper.core.tiers.transfer import remove_copy
from shardkeeper.core.tiers.wire import TierGroup
from shardkeeper.core.verify.step import verify_step

log = logging.getLogger(__name__)
#: gloo tags of a rebuild's pieces: ``TAG + round * 256 + shard``.
TAG = 1 << 26


def rebuild_lost(group: TierGroup, nodes: NodeMap, local: Any, asked: int | None) -> list[Job]:
    """Collective: the lost files of the newest step (or ``asked``) rebuilt from parity on
    their nodes, verified; returns the jobs done. Every local failure is agreed on."""
    me = group.rank
    where = f"rank {me}: rebuilding lost files from parity"
    mine, error = None, None
    if nodes.is_leader(me):
        try:
            mine = listing(local.raw)
        except Exception as e:  # every rank hears it (agreed below)
            error = e
    group.agree_ok(error, f"{where}: listing the parity")
    got = group.all_gather_json(mine, f"{where}: the parity's listings")
    jobs = plan([got[nodes.leader(k)] for k in range(len(nodes.nodes))], asked, len(nodes.nodes))
    for job in jobs:
        _manifest_to(group, nodes, local, job, [got[nodes.leader(k)] for k in range(len(nodes.nodes))])
        error = None
        try:
            _run(group, nodes, local, job)
        except Exception as e:  # this rank's own failure, or a sender's: agreed below
            group.check()
            error = e
        group.agree_ok(error, f"step {job.step}, {where}")
        if me == nodes.leader(job.target):
            shown = ", ".join(str(job.record["nodes"][i]) for i in job.lost)
            log.warning("rank %d: step %d: the files of node(s) %s rebuilt here from parity", me, job.step, shown)
    return jobs


def _manifest_to(group: TierGroup, nodes: NodeMap, local: Any, job: Job, listings: list[dict[str, Any]]) -> None:
    """The manifest of ``job.step`` put on the target node when it lacks it (one broadcast)."""
    holders = [n for n, lst in enumerate(listings) if job.step in lst["manifests"]]
    if job.target in holders:
        return
    me, src = group.rank, nodes.leader(holders[0])
    data, error = None, None
    if me == src:
        try:
            data = local.raw.read_bytes(manifest_path(job.step))
        except Exception as e:
            error = e
    data = group.broadcast_bytes(data, src, f"step {job.step}, rank {me}: the manifest for the rebuilt node")
    if me == nodes.leader(job.target) and error is None and data:
        try:
            if local.raw.exists(manifest_path(job.step)):
                local.storage.delete(manifest_path(job.step))  # a copy that does not validate
            local.raw.put_if_absent(manifest_path(job.step), data)
        except Exception as e:
            error = e
    group.agree_ok(error, f"step {job.step}, rank {me}: recording the manifest on the rebuilt node")


def _stream(local: Any, rec: dict[str, Any], shard: int) -> tuple[Concat, int]:
    """What ``shard`` of ``rec``'s group streams: a data node's files, or a parity file."""
    if shard < rec["k"]:
        files = [(p, int(s)) for p, s in rec["members"][shard]]
        return Concat(local.raw, files), rec["lengths"][shard]
    path = parity_name(rec["step"], rec["group"], shard - rec["k"])
    return Concat(local.raw, [(path, rec["length"])]), rec["length"]


def _run(group: TierGroup, nodes: NodeMap, local: Any, job: Job) -> None:
    """This rank's part of ``job``: stream the shards it holds to the target, or (the
    target's leader) receive k shards, decode and write the lost nodes' files, then verify."""
    me = group.rank
    target = nodes.leader(job.target)
    mine = {i: _stream(local, job.record, i) for i, n in job.sources.items() if nodes.leader(n) == me}
    if me != target:
        if mine:
            _send(group, job, mine, target)
        return
    rec, k = job.record, job.record["k"]
    for i in job.lost:
        for p, _ in rec["members"][i]:
            if local.raw.exists(p):
                remove_copy(local.storage, p)  # (a copy cut short: replaced)
    out = _Out(local.raw, rec, job.lost)
    try:
        hashes = _receive(group, nodes, job, mine, out)
        bad = [i - k for i, h in hashes.items() if h != job.digests[i]]
        if bad:
            raise CheckpointError(
                f"step {job.step}: parity shard(s) {bad} of group {rec['group']} fail their recorded digests (a "
                f"node's parity file is damaged); nothing rebuilt"
            )
        out.close()
    except BaseException:
        out.abort()
        raise
    _verify(local, job.step, out.paths)


def _piece(stream: tuple[Concat, int], buf: np.ndarray, off: int) -> np.ndarray:
    """``buf`` holding the stream's bytes at ``off``, zeros past its length."""
    reader, length = stream
    got = max(0, min(len(buf), length - off))
    if got:
        reader.read(off, memoryview(cast("Any", buf[:got])))
    buf[got:] = 0
    return buf


def _send(group: TierGroup, job: Job, mine: dict[int, tuple[Concat, int]], target: int) -> None:
    total = job.record["length"]
    bufs = {i: np.empty(min(PIECE_BYTES, total), dtype=np.uint8) for i in mine}
    for off in range(0, total, PIECE_BYTES):
        n, rnd = min(PIECE_BYTES, total - off), off // PIECE_BYTES
        works = [
            group.send(torch.from_numpy(_piece(stream, bufs[i][:n], off)), target, TAG + rnd * 256 + i)
            for i, stream in mine.items()
        ]
        for work in works:
            group.wait(work, f"step {job.step}, rank {group.rank}: the rebuild's pieces (to rank {target})")


def _receive(
    group: TierGroup, nodes: NodeMap, job: Job, mine: dict[int, tuple[Concat, int]], out: _Out
) -> dict[int, str]:
    """The target's rounds: k shards' pieces in, the lost files' pieces out; returns the
    xxh3-128 of each parity shard as it arrived."""
    rec, total = job.record, job.record["length"]
    code = Code(rec["k"], rec["m"])
    bufs = {i: np.empty(min(PIECE_BYTES, total), dtype=np.uint8) for i in job.sources}
    hashes = {i: xxhash.xxh3_128() for i in job.sources if i >= rec["k"]}
    for off in range(0, total, PIECE_BYTES):
        n, rnd = min(PIECE_BYTES, total - off), off // PIECE_BYTES
        works = []
        for i, src in job.sources.items():
            if i in mine:
                _piece(mine[i], bufs[i][:n], off)
            else:
                peer = nodes.leader(src)
                works.append((group.recv(torch.from_numpy(bufs[i][:n]), peer, TAG + rnd * 256 + i), peer))
        for work, peer in works:
            group.wait(work, f"step {job.step}, rank {group.rank}: the rebuild's pieces (from rank {peer})")
        blocks = {i: bufs[i][:n] for i in job.sources}
        for i, h in hashes.items():
            h.update(memoryview(cast("Any", blocks[i])))
        for i, block in code.decode(blocks, job.lost).items():
            out.write(i, block[: max(0, min(n, rec["lengths"][i] - off))])
    return {i: h.hexdigest() for i, h in hashes.items()}


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


def _verify(local: Any, step: int, paths: list[str]) -> None:
    """The rebuilt files checked against the manifest's digests; removed when they fail."""
    report = verify_step(local.read, step, files=paths)
    if report.problems:
        for p in paths:
            if local.raw.exists(p):
                remove_copy(local.storage, p)
        raise CheckpointError(
            f"step {step}: the files rebuilt from parity on {local.raw.url} fail the manifest's digests "
            f"({'; '.join(str(q) for q in report.problems[:3])}); removed. The step falls back"
        )


__all__ = ["rebuild_lost"]
