"""Two-tier checkpoints across simulated nodes (one torchrun agent per node, ``--nnodes``).

    tier_worker.py MODE OUT CONFIG_JSON

Every rank trains the same tiny model with AdamW on the same data (replicated, as under DDP)
and also holds a per-rank tensor. The node's local tier is ``CONFIG["locals"][TIER_NODE]``
(``TIER_NODE``: set per agent by the test); the persistent tier is ``CONFIG["root"]``.

- ``save``: save steps 1..CONFIG["steps"] (waiting for each upload), then start the save of
  the next step and, on node ``CONFIG["kill_node"]``, SIGKILL itself while it is in flight
  (the other node's ranks write a marker and wait to be killed by the test); without a
  ``kill_node`` that save is waited for, then the ranks wait to be killed.
- ``conflict``: the restore of a step the nodes hold different manifests of is refused.
- ``resume``: restore the newest step into a fresh model and compare parameters, Adam
  moments and the per-rank tensor bit for bit with a run trained to the restored step;
  write the tier restored from, the step, and the bytes read from the persistent tier.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from tests.checks import Checks

checks = Checks()
check = checks.check


def trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def per_rank(step: int, rank: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float64) * (step + 1) + rank


def frozen(rank: int) -> dict[str, object]:
    """State that never changes: with ``incremental`` every step after the first points at
    the first step's files for it (on the node of the rank that wrote them)."""
    return {
        "frozen": torch.arange(4096, dtype=torch.float32),
        "own_frozen": PerRank(torch.full((2048,), float(rank), dtype=torch.float32)),
    }


def manager(cfg: dict, **extra: object) -> CheckpointManager:
    node = int(os.environ["TIER_NODE"])
    kwargs: dict = {
        "storage_options": cfg.get("storage_options"),
        "local": cfg["locals"][node],
        "persist_every": cfg.get("persist_every"),
        "replicas": cfg.get("replicas", 0),
        "erasure": tuple(cfg["erasure"]) if cfg.get("erasure") else None,
        "local_keep": cfg.get("local_keep"),
        "commit_timeout_s": cfg.get("commit_timeout_s", 60),
        "min_file_bytes": 1,  # several files per rank, so replicas and repairs move several
        "incremental": cfg.get("incremental", False),
    }
    return CheckpointManager(cfg["root"], **{**kwargs, **extra})


def save(out: Path, cfg: dict) -> None:
    rank, node = dist.get_rank(), int(os.environ["TIER_NODE"])
    mgr = manager(cfg)
    for step in range(1, cfg["steps"] + 1):
        model, opt = trained(step)
        mgr.save(step, {"model": model, "optim": opt, "own": PerRank(per_rank(step, rank)), **frozen(rank)})
        mgr.wait_persisted()
    check("persisted", mgr.persisted_steps == cfg["expect_persisted"], mgr.persisted_steps)
    model, opt = trained(cfg["steps"] + 1)
    last = {"model": model, "optim": opt, "own": PerRank(per_rank(cfg["steps"] + 1, rank)), **frozen(rank)}
    mgr.save(cfg["steps"] + 1, last)
    checks.write(out / f"save-r{rank}.json")
    if node == cfg.get("kill_node"):
        (out / f"killed-r{rank}").write_text("in flight")
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.get("kill_node") is None:
        mgr.wait()  # no node is lost: the last save commits too
    (out / f"waiting-r{rank}").write_text("alive")
    time.sleep(600)  # the test kills this agent too: the save in flight never commits


def resume(out: Path, cfg: dict) -> None:
    rank = dist.get_rank()
    mgr = manager(cfg)
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 16)).sum().backward()
    opt.step()  # state to overwrite
    own = torch.zeros(1000, dtype=torch.float64)
    still = {k: torch.zeros_like(v.value if isinstance(v, PerRank) else v) for k, v in frozen(rank).items()}
    target = {"model": model, "optim": opt, "own": PerRank(own), "frozen": still["frozen"]}
    target["own_frozen"] = PerRank(still["own_frozen"])
    step = mgr.restore(target, per_rank=cfg.get("per_rank", "exact"))
    ref_model, ref_opt = trained(step)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()))
    check("parameters bit-exact", same)
    mine, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    moments = all(torch.equal(mine[k][n], ref[k][n]) for k in ref for n in ("exp_avg", "exp_avg_sq", "step"))
    check("Adam state bit-exact", moments and len(mine) == len(ref))
    saved_rank = rank % cfg.get("saved_world", dist.get_world_size())
    check("per-rank tensor bit-exact", torch.equal(own, per_rank(step, saved_rank)))
    want = frozen(saved_rank)
    check("unchanged tensors bit-exact", torch.equal(still["frozen"], want["frozen"]))
    check("unchanged per-rank tensor bit-exact", torch.equal(still["own_frozen"], want["own_frozen"].value))
    stats = mgr.last_restore_stats
    info = {
        "step": step,
        "tier": mgr.last_restore_tier,
        "persistent_reads": mgr.persistent_reads,
        "bytes_read": stats.bytes_read if stats else None,
    }
    (out / f"resume-r{rank}.json").write_text(json.dumps(info))
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def faults(out: Path, cfg: dict) -> None:
    """Node 1 cannot write step 2 (a file stands where its step directory goes): every rank's
    save fails at once naming that rank's write, nobody waits for the timeout, and step 3
    commits on both nodes (the tiers' group is still in step)."""
    from shardkeeper.core import CheckpointSaveError

    rank, node = dist.get_rank(), int(os.environ["TIER_NODE"])
    mgr = manager(cfg)
    model, opt = trained(1)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    if node == 1 and rank == min(r for r in range(dist.get_world_size()) if r >= 2):
        (Path(cfg["locals"][1]) / "step-000000000002").write_text("not a directory")
    dist.barrier()
    t0 = time.monotonic()
    try:
        mgr.save(2, {"model": model, "optim": opt}).wait()
    except CheckpointSaveError as e:
        check("save 2 fails naming a node-1 rank's write", "in phase write" in str(e), str(e))
        check("and within the commit timeout", time.monotonic() - t0 < cfg["commit_timeout_s"], time.monotonic() - t0)
    else:
        check("save 2 fails", False)
    mgr.save(3, {"model": model, "optim": opt}).wait()
    check("step 3 committed in this node's directory", (Path(cfg["locals"][node]) / "step-000000000003" / "manifest.json").exists())
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def mismatch(out: Path, cfg: dict) -> None:
    """Tier options that differ between the nodes are refused on every rank when the managers
    open, at once and by name (no rank waits for a collective the others skip)."""
    rank, node = dist.get_rank(), int(os.environ["TIER_NODE"])
    t0 = time.monotonic()
    try:
        manager(cfg, replicas=node).close()  # (manager() passes replicas from cfg: overridden here)
    except ValueError as e:
        check("different replicas refused", "different tier options" in str(e) and "replicas" in str(e), str(e))
    else:
        check("different replicas refused", False)
    try:  # named by root and rank, each value as passed (before: "replicas: 0" for node 0, erasure as a list)
        manager(cfg, **({"erasure": (1, 1)} if node == 0 else {"replicas": 1})).close()
    except ValueError as e:
        said = (str(e), f"{cfg['root']}, rank {rank}: ", "rank 0: erasure=(1, 1), replicas not passed;")
        check("different erasure= refused by root and rank", said[1] in said[0] and said[2] in said[0], said)
    else:
        check("different erasure= refused by root and rank", False)
    try:  # too few nodes for the code: the root, the rank and every alternative named
        manager(cfg, erasure=(2, 1)).close()
    except ValueError as e:
        said = (str(e), f"{cfg['root']}, rank {rank}: erasure=(2, 1) needs at least k + m = 3 nodes", "replicas=1")
        check("too few nodes refused by root and rank", said[1] in said[0] and said[2] in said[0], said)
    else:
        check("too few nodes refused by root and rank", False)
    try:
        if node == 0:
            manager(cfg).close()
        else:
            CheckpointManager(cfg["root"], storage_options=cfg.get("storage_options")).close()
    except ValueError as e:
        check("local= on one node only refused", "some ranks passed local=" in str(e), str(e))
    else:
        check("local= on one node only refused", False)
    check("both within the commit timeout", time.monotonic() - t0 < cfg["commit_timeout_s"], time.monotonic() - t0)
    checks.write(out / f"checks-r{rank}.json")


def conflict(out: Path, cfg: dict) -> None:
    """The nodes hold different manifests of the newest step: the restore raises on every
    rank at once, naming both copies and the remedy, and restores nothing."""
    from shardkeeper.core import CheckpointError

    rank = dist.get_rank()
    mgr = manager(cfg)
    model, _ = trained(0)
    before = [p.detach().clone() for p in model.parameters()]
    t0 = time.monotonic()
    try:
        mgr.restore({"model": model})
    except CheckpointError as e:
        text = str(e)
        named = "different manifests of step 4" in text and "node 0 (ranks 0-1)" in text and "node 1 (ranks 2-3)" in text
        check("the conflict is refused by name", named and "rm -r DIR/step-000000000004" in text, text)
    else:
        check("the conflict is refused by name", False, "restored")
    check("nothing restored", all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    check("at once", time.monotonic() - t0 < cfg["commit_timeout_s"], time.monotonic() - t0)
    mgr.close()
    checks.write(out / f"checks-r{rank}.json")


def main() -> None:
    mode, out, cfg = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    {"save": save, "resume": resume, "faults": faults, "mismatch": mismatch, "conflict": conflict}[mode](out, cfg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
