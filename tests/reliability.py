"""Regenerate the figures of docs/reliability.md (``nox -s reliability``, or run it directly).

Runs, on this machine: the kill -9 campaign on local disk and on a moto S3 server (6 MiB
shard files, so kills land inside multipart uploads), and saves/restores through the fault
proxy in front of moto. Writes the JSON summaries to docs/reliability.json and the table
between the figure markers of docs/reliability.md. Exits 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.update(
    {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
)

from tests.conftest import _free_port, _moto_command, _stop, _wait_ready, s3_storage_options  # noqa: E402

BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


def _proxy_run(endpoint: str, saves: int, seed: int) -> dict[str, Any]:
    import s3fs

    from shardkeeper.core import CheckpointManager, metrics
    from shardkeeper.core.testing.campaign import _blank_like, deterministic_state
    from tests.checks import state_diff
    from tests.faultproxy import FaultProxy

    fs = s3fs.S3FileSystem(**s3_storage_options(endpoint), use_listings_cache=False)
    bucket = f"sk-rel-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    before = metrics.UPLOAD_ERRORS.total()
    exact = 0
    with FaultProxy(endpoint, rate=0.2, seed=seed, delay_s=1.5) as proxy:
        opts = s3_storage_options(proxy.endpoint)
        opts["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "read_timeout": 1.0, "connect_timeout": 1.0}
        mgr = CheckpointManager(
            f"s3://{bucket}/run",
            storage_options=opts,
            keep_last=2,
            retry_max_attempts=8,
            retry_base_delay_s=0.01,
            retry_max_delay_s=0.1,
        )
        mgr.storage.fs.retries = 1  # type: ignore[attr-defined]
        for step in range(saves):
            mgr.save(step, deterministic_state(step, 256 << 10)).wait()
            want = deterministic_state(step, 256 << 10)
            got = _blank_like(want)
            if mgr.restore(got) == step and not state_diff(got["model"], want["model"]):
                exact += 1
        mgr.close()
    fs.rm(bucket, recursive=True)
    return {
        "saves": saves,
        "restores_bit_exact": exact,
        "requests": proxy.requests,
        "faults_injected": dict(proxy.injected),
        "errors_counted": metrics.UPLOAD_ERRORS.total() - before,
        "lost": saves - exact,
    }


def _table(res: dict[str, Any]) -> str:
    loc, s3, px = res["campaign_local"], res["campaign_s3"], res["fault_proxy"]
    rows = [
        "| run | trials / saves | killed / faults | kill points hit | bit-exact restores | leftovers removed | lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in (("kill -9, local disk", loc), ("kill -9, moto S3 (multipart)", s3)):
        hit = ", ".join(f"{k} {v}" for k, v in c["kill_points_hit"].items())
        rows.append(
            f"| {name} | {c['trials']} | {c['killed']} | {hit} | {c['restores_bit_exact']} | "
            f"{c['leftovers_removed']} files/dirs, {c['incomplete_uploads_aborted']} uploads | {c['lost_or_damaged']} |"
        )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(px["faults_injected"].items()))
    rows.append(
        f"| fault proxy, moto S3 | {px['saves']} saves + restores ({px['requests']} requests) | {faults} | - | "
        f"{px['restores_bit_exact']} | - | {px['lost']} |"
    )
    when = time.strftime("%Y-%m-%d", time.gmtime())
    return (
        f"Generated {when} by tests/reliability.py, what `nox -s reliability` runs (seed {res['seed']}, "
        f"{res['seconds']:.0f} s on this machine; {res['args']}).\n\n" + "\n".join(rows) + "\n"
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--s3-trials", type=int, default=40)
    p.add_argument("--proxy-saves", type=int, default=20)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    a = p.parse_args()

    from shardkeeper.core.testing.campaign import run_campaign

    t0 = time.monotonic()
    res: dict[str, Any] = {"seed": a.seed, "args": " ".join(sys.argv[1:]) or "defaults"}
    with tempfile.TemporaryDirectory() as tmp:
        res["campaign_local"] = run_campaign(
            f"{tmp}/root", trials=a.trials, seed=a.seed, tensor_bytes=256 << 10
        ).to_json()
    port = _free_port()
    log_path = Path(tempfile.mkdtemp()) / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_moto_command(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, f"{endpoint}/moto-api/", log_path)
        import s3fs

        fs = s3fs.S3FileSystem(**s3_storage_options(endpoint), use_listings_cache=False)
        bucket = f"sk-rel-{uuid.uuid4().hex[:10]}"
        fs.mkdir(bucket)
        res["campaign_s3"] = run_campaign(
            f"s3://{bucket}/run",
            trials=a.s3_trials,
            seed=a.seed,
            tensor_bytes=6 << 20,
            storage_options={**s3_storage_options(endpoint), "part_size_bytes": 5 << 20},
            manager_options={"max_files_per_rank": 1},
        ).to_json()
        res["fault_proxy"] = _proxy_run(endpoint, a.proxy_saves, a.seed)
    finally:
        _stop(proc)
    res["seconds"] = time.monotonic() - t0
    lost = res["campaign_local"]["lost_or_damaged"] + res["campaign_s3"]["lost_or_damaged"] + res["fault_proxy"]["lost"]
    print(json.dumps(res, indent=1))
    if not a.no_write:
        (ROOT / "docs" / "reliability.json").write_text(json.dumps(res, indent=1) + "\n")
        doc = ROOT / "docs" / "reliability.md"
        text = doc.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        doc.write_text(f"{head}{BEGIN}\n{_table(res)}{END}{tail}")
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
