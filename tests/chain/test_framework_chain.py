"""One run moved across frameworks, one root (a local directory), each hop a new torchrun launch:

1. DeepSpeed ZeRO-3 fp32 engine, world 2: 3 steps, saved through the engine hook;
2. FSDP2 (``fully_shard``) with the core ``CheckpointManager``, world 3: restore, 2 steps, save;
3. a Lightning Trainer (ddp), world 2: ``fit(ckpt_path=root)``, 2 steps, ``save_checkpoint``;
4. ``Accelerator(cpu=True)`` with the shardkeeper plugin, world 2: ``load_state``, 2 steps,
   ``save_state``;
5. the Hugging Face Trainer (``ShardkeeperTrainer``, DDP), world 2:
   ``train(resume_from_checkpoint=True)``, 2 steps, its save at the end;
6. plain torch, one process: ``CheckpointManager.restore`` into a module and Adam.

The same model and Adam settings everywhere (tests/chain/common.py). After every hop: the
framework's step counter after the load equals the step loaded, its save lands at that step +
the steps trained (Accelerate's ``save_state()`` numbers saves: at that step + 1), the root's newest committed step only increases and is the step just saved;
the parameters, Adam moments and Adam's ``step`` restored equal, bit for bit, what the previous
hop held when it saved. One test per hop reports every check of that hop with its values.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shardkeeper.core import CheckpointManager
from tests.chain.common import HOPS
from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess]

HERE = Path(__file__).parent
#: (worker, world size, the checks the hop must report)
LAUNCHES = {
    "deepspeed": ("ds_worker.py", 2, 4),
    "fsdp2": ("fsdp2_worker.py", 3, 6),
    "lightning": ("lightning_worker.py", 2, 7),
    "accelerate": ("accelerate_worker.py", 2, 8),
    "transformers": ("transformers_worker.py", 2, 6),
    "plain": ("plain_worker.py", 1, 4),
}
ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _merge(out: Path, index: int, world: int) -> tuple[list[dict], list[str]]:
    """Every rank's checks, one row per check (failed if it failed on any rank)."""
    rows: dict[str, dict] = {}
    missing = []
    for rank in range(world):
        f = out / f"hop{index}-r{rank}.json"
        if not f.exists():
            missing.append(f"rank {rank} wrote no results")
            continue
        for c in json.loads(f.read_text()):
            row = rows.setdefault(c["check"], {**c, "ok": True, "failed_on": []})
            if not c["ok"]:
                if not row["failed_on"]:
                    row["ok"], row["detail"] = False, f"rank {rank}: {c['detail']}"
                row["failed_on"].append(rank)
    for row in rows.values():
        if len(row["failed_on"]) > 1:
            row["detail"] += f" (failed on ranks {row['failed_on']})"
    return list(rows.values()), missing


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run the hops in order; a launch that exits non-zero ends the chain there."""
    out = tmp_path_factory.mktemp("chain")
    root = str(out / "root")
    report: dict[str, dict] = {}
    for index, name in enumerate(HOPS, 1):
        script, world, _ = LAUNCHES[name]
        if any(r["rc"] != 0 for r in report.values()):
            report[name] = {"rc": None, "checks": [], "missing": ["not run: an earlier hop's launch failed"]}
            continue
        t0 = time.monotonic()
        proc = run_script(world, HERE / script, root, str(out), timeout_s=180, env=ENV)
        checks, missing = _merge(out, index, world)
        report[name] = {
            "rc": proc.returncode,
            "checks": checks,
            "missing": missing,
            "tail": proc.stdout[-4000:],
            "wall_s": time.monotonic() - t0,
            "world": world,
        }
    with CheckpointManager(root) as mgr:
        report["_root"] = {"steps": mgr.steps()}
    return report


def _table(name: str, hop: dict) -> str:
    took = f", {hop['wall_s']:.0f} s at world size {hop['world']}" if "wall_s" in hop else ""
    lines = [f"hop {HOPS.index(name) + 1} ({name}), launch exit status {hop['rc']}{took}:"]
    lines += [f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {c['detail']}" for c in hop["checks"]]
    lines += [f"  FAIL  {m}" for m in hop["missing"]]
    return "\n".join(lines)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", HOPS)
def test_hop_resumes_step_count_and_state(chain: dict[str, dict], name: str) -> None:
    hop = chain[name]
    table = _table(name, hop)
    print(table)  # every check of the hop, passed or not (pytest -rA / -s shows it)
    tail = f"\n--- launch output (tail) ---\n{hop.get('tail', '')}" if hop["rc"] not in (0, None) else ""
    assert hop["rc"] == 0, table + tail
    expected = LAUNCHES[name][2]
    assert not hop["missing"] and len(hop["checks"]) == expected, (
        f"{table}\n(expected {expected} checks; the root's committed steps at the end: {chain['_root']['steps']})"
    )
    assert all(c["ok"] for c in hop["checks"]), (
        f"{table}\n(the root's committed steps at the end: {chain['_root']['steps']})"
    )
