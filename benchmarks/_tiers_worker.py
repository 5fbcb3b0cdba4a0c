"""One rank of ``benchmarks/tiers.py`` (two torchrun agents, ``TIER_NODE`` per agent).

    _tiers_worker.py OUT CONFIG_JSON

Each rank holds ``mib`` MiB of its own state (``PerRank``). In one launch, every figure from
the same bytes (the anchors and the local restore: the fastest of 3 runs, the page cache
dropped before each read): the raw anchors (a write+fsync of the rank's bytes to its node's
directory, a gloo transfer of them to its replica peer, that transfer with the peer's
write+fsync of them, a read of them after the page cache was dropped),
a tiered save (stall and time to locally committed, after a warm-up save and with no upload
running, as between two uploads in training; then a save's time to persisted),
the same save straight to S3, and
restores from the local tier, from a peer (node 1's directory deleted first, as a replaced
node) and from S3. Writes ``OUT/r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _proc import evict, tree_bytes  # noqa: E402

from shardkeeper.core import CheckpointManager, PerRank  # noqa: E402


def barrier() -> None:
    dist.barrier()


def timed(fn: object, repeat: int = 1, before: object = None) -> float:
    """The fastest of ``repeat`` runs of ``fn`` (``before`` runs ahead of each, untimed), each
    started on every rank together."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()  # type: ignore[operator]
        barrier()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
        barrier()
    return best


def write_fsync(path: Path, t: torch.Tensor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(t.numpy()).cast("B")
        pos = 0
        while pos < len(view):
            pos += os.write(fd, view[pos : pos + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["TIER_NODE"])
    local = Path(cfg["locals"][node])
    n = cfg["mib"] << 18  # float32 elements
    value = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    nbytes = value.numel() * 4
    res: dict[str, float | int] = {"bytes": nbytes}

    # -- raw anchors -----------------------------------------------------------------------
    raw = local / f"raw-r{rank}.bin"
    local.mkdir(parents=True, exist_ok=True)

    res["raw_write_fsync_s"] = timed(lambda: write_fsync(raw, value), 3)
    peer_of = {r: (r + 2) % world for r in range(world)}  # the other node's rank, as replicas=1 places them
    src = [r for r, p in peer_of.items() if p == rank][0]
    buf = torch.empty_like(value)

    def transfer() -> None:
        works = [dist.isend(value, peer_of[rank]), dist.irecv(buf, src)]
        for w in works:
            w.wait()

    res["raw_transfer_s"] = timed(transfer, 3)
    got = local / f"raw-from-r{src}.bin"

    def replica() -> None:  # the raw equivalent of a durable replica: send, and the peer writes+fsyncs
        transfer()
        write_fsync(got, buf)

    res["raw_replica_s"] = timed(replica, 3)
    got.unlink()

    def read() -> None:
        with open(raw, "rb", buffering=0) as f:
            target = memoryview(buf.numpy()).cast("B")
            pos = 0
            while pos < len(target):
                pos += f.readinto(target[pos : pos + (64 << 20)])  # type: ignore[arg-type]

    res["raw_read_s"] = timed(read, 3, lambda: evict(raw))
    raw.unlink()

    # -- saves -----------------------------------------------------------------------------
    opts = {"storage_options": cfg["storage_options"], "min_file_bytes": 64 << 20}
    state = {"own": PerRank(value)}
    quiet = CheckpointManager(cfg["root"], local=str(local), replicas=1, **opts)  # no upload beside it
    quiet.save(1, state).wait()  # warm-up: the staging buffer and the plan are made once per manager
    barrier()
    t0 = time.perf_counter()
    h = quiet.save(2, state)
    h.wait()
    res["tier_stall_s"] = h.stall_s
    res["tier_local_commit_s"] = time.perf_counter() - t0
    quiet.close()
    mgr = CheckpointManager(cfg["root"], local=str(local), replicas=1, persist_every=1, **opts)
    barrier()
    t0 = time.perf_counter()
    mgr.save(3, state).wait()
    mgr.wait_persisted()
    res["tier_persisted_s"] = time.perf_counter() - t0
    barrier()
    direct = CheckpointManager(cfg["direct"], **opts)
    direct.save(1, state).wait()
    barrier()
    t0 = time.perf_counter()
    h = direct.save(2, state)
    h.wait()
    res["s3_stall_s"] = h.stall_s
    res["s3_commit_s"] = time.perf_counter() - t0

    # -- restores --------------------------------------------------------------------------
    target = {"own": PerRank(torch.zeros_like(value))}
    res["restore_local_s"] = timed(lambda: mgr.restore(target), 3, lambda: evict(local))
    assert mgr.last_restore_tier == "local" and mgr.persistent_reads == 0
    assert torch.equal(target["own"].value, value)  # type: ignore[attr-defined]
    mgr.close()
    barrier()
    if node == 1 and rank == min(r for r in range(world) if r >= 2):
        shutil.rmtree(local)  # node 1 replaced by an empty one
    barrier()
    target = {"own": PerRank(torch.zeros_like(value))}
    again = CheckpointManager(cfg["root"], local=str(local), replicas=1, **opts)
    res["restore_peer_s"] = timed(lambda: again.restore(target))
    assert again.last_restore_tier == "local" and again.persistent_reads == 0
    assert torch.equal(target["own"].value, value)  # type: ignore[attr-defined]
    res["node_bytes_after_peer_restore"] = tree_bytes(local)
    again.close()
    target = {"own": PerRank(torch.zeros_like(value))}
    res["restore_s3_s"] = timed(lambda: direct.restore(target))
    assert torch.equal(target["own"].value, value)  # type: ignore[attr-defined]
    direct.close()
    (out / f"r{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
