"""The erasure-coded node tier on 4 gloo ranks, each its own local directory (four simulated
nodes, one rank each; with ``CONFIG["per_node"] = 2`` two nodes of two ranks, sharing one);
the persistent root a local directory.

    erasure_worker.py MODE OUT CONFIG_JSON

Each rank saves a replicated tensor and a per-rank one of a length of its own (the nodes'
data differ in length), steps 1..3 with ``persist_every=100`` (step 1 alone is uploaded) and
the manager's options ``CONFIG["options"]`` (the codecs).
The nodes named in ``CONFIG["lose"]`` then lose their directories (replaced by empty ones)
and a new manager restores into zeroed tensors.

Before the restore, ``ls --local`` shows step 3 recoverable (``rebuild``) or partial.

- ``rebuild``: the newest step restores bit for bit from the local tier, rebuilt from
  parity, with no byte read from the persistent root; the lost nodes hold its files again,
  and ``last_restore_stats.rebuilt`` names them. With ``CONFIG["harm"]`` flipping a byte
  of nodes' step-3 files (nothing lost): those damaged copies are rebuilt as if lost, every
  node's step 3 then checks out against its manifest, and no node dropped the step.
- ``damaged``: a byte of the newest step's parity flipped as well (or the files named in
  ``CONFIG["harm"]`` flipped or cut short): its rebuild fails that piece's digest, and step
  2 (``CONFIG["restored"]``) is rebuilt and restored instead, from the local tier.
- ``fallback``: more nodes of a group lost than it has parity (or the parity directory of
  node ``CONFIG["link"]`` made a symbolic link): the restore falls back to the persisted step 1.
- ``linked``: as ``fallback`` with ``CONFIG["link"]``, then a save that fails there and one
  after the link is gone leave no parity of the failed step.
- ``nothing``: the same with nothing uploaded (``CONFIG["persist_every"]`` None): the
  restore's error says which steps, group and nodes were lost (``CONFIG["said"]``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from shardkeeper.core.cli.tiers_ls import add_tiers, tiers_cell
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.step import verify_step
from tests.checks import Checks

checks = Checks()
check = checks.check
#: Elements of the per-rank tensor: about 4.6 MiB, two pieces of parity (``erasure.PIECE_BYTES``),
#: spread over the nodes outside each group.
SIZE = 600_000


def shared(step: int) -> torch.Tensor:
    return torch.arange(3000, dtype=torch.float32) * step


def own(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(SIZE + 1531 * rank, generator=g, dtype=torch.float64)


def frozen(rank: int) -> torch.Tensor:
    """The same every step: with ``incremental`` later steps point at step 1's files for it."""
    return torch.full((50_000,), float(rank))


def node_dir(cfg: dict[str, Any]) -> Path:
    """This rank's node's directory: ``CONFIG["per_node"]`` consecutive ranks share one."""
    return Path(cfg["locals"][dist.get_rank() // cfg.get("per_node", 1)])


def manager(cfg: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(
        cfg["root"],
        local=node_dir(cfg),
        erasure=tuple(cfg["erasure"]),
        persist_every=cfg.get("persist_every", 100),
        commit_timeout_s=60,
        **cfg.get("options", {}),
    )


def save_then_lose(cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    mgr = manager(cfg)
    for step in (1, 2, 3):
        mgr.save(
            step, {"shared": shared(step), "own": PerRank(own(step, rank)), "frozen": PerRank(frozen(rank))}
        ).wait()
    mgr.wait_persisted()
    mgr.close()
    node, leader = divmod(rank, cfg.get("per_node", 1))
    held = sorted(p.name for p in (node_dir(cfg) / ".parity" / "step-000000000003").glob("*"))
    check(f"node {node} holds the parity it should", held == cfg["parity"][node], held)
    dist.barrier()
    if node in cfg["lose"] and leader == 0:
        shutil.rmtree(node_dir(cfg))
        node_dir(cfg).mkdir()  # the replaced node's empty directory
    if cfg.get("damage") and node == cfg["damage"][0] and leader == 0:  # a byte of a parity file flipped
        f = node_dir(cfg) / ".parity" / "step-000000000003" / cfg["damage"][1]
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    for at, pattern, how in cfg.get("harm", []):  # a file of this node's cut short or a byte flipped
        if node == at and leader == 0:
            (f,) = node_dir(cfg).glob(pattern)
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data[: len(data) // 2] if how == "cut" else data))
    if cfg.get("link") == node and leader == 0:  # its parity moved away, a symbolic link in its place
        parity, away = node_dir(cfg) / ".parity", node_dir(cfg).parent / f"parity-of-node{node}"
        parity.rename(away)
        parity.symlink_to(away)
    if cfg.get("redirect") and leader == 0:
        _redirect(cfg, node)
    dist.barrier()
    if rank == 0 and not cfg.get("redirect"):  # what `shardkeeper ls ROOT --local DIR...` shows of the nodes left
        rows: list[dict[str, Any]] = []
        add_tiers(rows, cfg["locals"])
        row = next(r for r in rows if r["step"] == 3)
        want = "partial" if cfg["mode"] in ("fallback", "nothing") else "recoverable"  # (ls does not check digests)
        want = cfg.get("ls", want)
        check(f"ls --local shows step 3 {want}", tiers_cell(row).endswith(f"({want})"), tiers_cell(row))


def _redirect(cfg: dict[str, Any], node: int) -> None:
    """Node 1 loses only its step-3 data file, and node 3's parity record of group 0 is edited
    (its digests intact) to name node 1's step-2 data file as the file to rebuild."""
    one = Path(cfg["locals"][1])
    if node == 1:
        (f3,) = (one / "step-000000000003" / "data").glob("r00001-*.safetensors")
        f3.unlink()
    if node == 3:
        (f2,) = (one / "step-000000000002" / "data").glob("r00001-*.safetensors")
        record = Path(cfg["locals"][3]) / ".parity" / "step-000000000003" / "g0-p0.json"
        doc = json.loads(record.read_text())
        doc["members"][1] = [[f"step-000000000002/data/{f2.name}", size] for _, size in doc["members"][1]][:1]
        record.write_text(json.dumps(doc))


def restore(cfg: dict[str, Any]) -> tuple[int, CheckpointManager, dict[str, Any]]:
    rank = dist.get_rank()
    mgr = manager(cfg)
    target = {
        "shared": torch.zeros(3000),
        "own": PerRank(torch.zeros(SIZE + 1531 * rank, dtype=torch.float64)),
        "frozen": PerRank(torch.zeros(50_000)),
    }
    step = mgr.restore(target)
    return step, mgr, target


def rebuild(out: Path, cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    save_then_lose(cfg)
    step, mgr, got = restore(cfg)
    check("the newest step restored", step == 3, step)
    check("from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
    check("no byte read from the persistent root", mgr.persistent_reads == 0, mgr.persistent_reads)
    check("replicated tensor bit-exact", torch.equal(got["shared"], shared(3)))
    check("per-rank tensor bit-exact", torch.equal(got["own"].value, own(3, rank)))
    check("unchanged per-rank tensor bit-exact", torch.equal(got["frozen"].value, frozen(rank)))
    mine = sorted(p.name for p in (node_dir(cfg) / "step-000000000003" / "data").glob("*"))
    check("this node holds the step's data again", any(f"r{rank:05d}-" in name for name in mine), mine)
    per_node = cfg.get("per_node", 1)
    rebuilt = getattr(mgr.last_restore_stats, "rebuilt", None)  # (None: not reported)
    for node in sorted({*cfg["lose"], *(h[0] for h in cfg.get("harm", []))}):
        for r in range(node * per_node, (node + 1) * per_node):
            check(f"the stats name rank {r}'s files rebuilt", any(f"/r{r:05d}-" in p for p in rebuilt or []), rebuilt)
    if cfg.get("harm") and rank == 0:  # the damaged copies rebuilt: every node's step 3 checks out, none dropped it
        for n, where in enumerate(cfg["locals"]):
            kept = Path(where, "step-000000000003", "manifest.json").exists()
            check(f"node {n} keeps step 3", kept)
            problems = [str(q) for q in verify_step(LocalStorage(where), 3).problems] if kept else ["dropped"]
            check(f"node {n}'s step 3 checks out", not problems, problems[:3])
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def damaged(out: Path, cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    save_then_lose(cfg)
    step, mgr, got = restore(cfg)
    want = cfg.get("restored", 2)
    check("the step before the damaged parity's restored", step == want, step)
    check("from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
    check("no byte read from the persistent root", mgr.persistent_reads == 0, mgr.persistent_reads)
    check("per-rank tensor bit-exact", torch.equal(got["own"].value, own(want, rank)))
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def redirected(out: Path, cfg: dict[str, Any]) -> None:
    """A record that names another step's file: nothing written over it, step 2 restored."""
    rank = dist.get_rank()
    save_then_lose(cfg)
    (f2,) = (Path(cfg["locals"][1]) / "step-000000000002" / "data").glob("r00001-*.safetensors")
    before = f2.read_bytes()
    step, mgr, got = restore(cfg)
    check("the step before the forged record's restored", step == 2, step)
    check("from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
    check("per-rank tensor bit-exact", torch.equal(got["own"].value, own(2, rank)))
    check("node 1's step-2 file untouched", f2.read_bytes() == before)
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def fallback(out: Path, cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    save_then_lose(cfg)
    step, mgr, got = restore(cfg)
    check("the persisted step restored", step == 1, step)
    check("from the persistent root", mgr.last_restore_tier == "persistent", mgr.last_restore_tier)
    check("per-rank tensor bit-exact", torch.equal(got["own"].value, own(1, rank)))
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def linked(out: Path, cfg: dict[str, Any]) -> None:
    """Node ``CONFIG["link"]``'s ``.parity`` a symbolic link: the persisted step 1 restored, and
    a save of step 4 fails leaving no parity of it on any node; with the link gone and a
    killed save's parity of step 4 left on that node, the next save's commit removes it."""
    rank, base = dist.get_rank(), Path(cfg["locals"][0]).parent
    node, leader = divmod(rank, cfg.get("per_node", 1))
    save_then_lose(cfg)
    step, mgr, _ = restore(cfg)
    check("the persisted step restored", step == 1, step)
    state = {"shared": shared(4), "own": PerRank(own(4, rank)), "frozen": PerRank(frozen(rank))}
    try:
        mgr.save(4, state).wait()
        check("the save with a node's parity a link fails", False)
    except CheckpointError as e:
        check("the save's error names the link", "symbolic link" in str(e), str(e))
    dist.barrier()
    left = sorted(str(p) for p in base.glob("*/.parity/step-000000000004"))
    check("no node keeps the failed save's parity", left == [], left)
    dist.barrier()
    parity = node_dir(cfg) / ".parity"
    if node == cfg["link"] and leader == 0:  # the link replaced by what it pointed at
        parity.unlink()
        (base / f"parity-of-node{node}").rename(parity)
        shutil.copytree(parity / "step-000000000001", parity / "step-000000000004")  # a killed save's
        (node_dir(cfg) / "step-000000000004").mkdir(exist_ok=True)
    dist.barrier()
    mgr.save(5, {**state, "shared": shared(5)}).wait()
    dist.barrier()
    left = sorted(str(p) for p in base.glob("*/.parity/step-000000000004"))
    check("the next commit removes a killed save's parity", left == [], left)
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def nothing(out: Path, cfg: dict[str, Any]) -> None:
    """More losses than parity and nothing uploaded: the restore finds nothing, and says why."""
    rank = dist.get_rank()
    save_then_lose(cfg)
    mgr = manager(cfg)
    try:
        mgr.restore({"own": PerRank(torch.zeros(SIZE + 1531 * rank, dtype=torch.float64))})
        check("nothing restores", False)
    except CheckpointNotFoundError as e:
        for want in cfg["said"]:
            check(f"the error says {want!r}", want in str(e), str(e))
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    for run in runs:
        where = out / run["name"]
        where.mkdir(parents=True, exist_ok=True)
        modes = {"rebuild": rebuild, "damaged": damaged, "redirected": redirected, "fallback": fallback}
        {**modes, "nothing": nothing, "linked": linked}[run["mode"]](where, run)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
