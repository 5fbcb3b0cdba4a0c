"""Real processes at the scale this machine holds: 16 gloo ranks save and restore FSDP2 and
DDP states, on local disk and on a real S3 server, bit for bit.

    python benchmarks/ranks16.py [--nproc 16] [--out-dir benchmarks/results] [--no-s3] [--group-ranks N]

For each root (a local directory; a bucket on a moto S3 server started here, behind a
counting proxy on loopback): one torchrun launch saves an FSDP2 state (recorded by its layout
rule) and a DDP state, and one more restores each into both layouts and compares parameters
and AdamW state with the saved run's, bit for bit (``_ranks16_worker.py``). Reports, summed
over ranks: the save protocol's store round trips and bytes; the bytes each restore read
from storage over the bytes the checkpoint holds (replicated ones are read once and shared);
the index files read; and, on S3, the HTTP requests of each save and restore by method.
Writes ``ranks16-<date>.json`` and ``.md``; exits 1 when a restore was not bit-exact.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.launch, tests.faultproxy: the suites' launcher and proxy

from tests.faultproxy import FaultProxy  # noqa: E402
from tests.launch import run_script  # noqa: E402

AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **AWS}
        )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")


def phase(nproc: int, name: str, root: str, opts: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    res = run_script(
        nproc, HERE / "_ranks16_worker.py", name, root, json.dumps(opts), str(out), timeout_s=900, env={**AWS}
    )
    if res.returncode != 0:
        errors = [ln for ln in res.stdout.splitlines() if ln.startswith("[rank") and "Error:" in ln]
        raise RuntimeError(f"{name} on {root}: exit {res.returncode}\n" + "\n".join([*errors[:8], res.stdout[-3000:]]))
    return [json.loads((out / f"{name}-r{r}.json").read_text()) for r in range(nproc)]


def summarize(saves: list[dict[str, Any]], restores: list[dict[str, Any]], sizes: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("fsdp2", "ddp"):
        calls = sum((Counter(s[layout]["store_calls"]) for s in saves), Counter())
        out[f"save {layout}"] = {
            "store_round_trips": sum(calls.values()),
            "store_round_trips_by_call": dict(calls),
            "store_bytes_sent": sum(s[layout]["report_bytes"] for s in saves),
            "checkpoint_bytes": sizes[layout],
        }
    for case in (k for k in restores[0] if "->" in k):
        src = case.split("->")[0]
        read = sum(r[case]["bytes_read"] for r in restores)
        out[f"restore {case}"] = {
            "bit_exact": all(not r[case]["wrong"] for r in restores),
            "wrong": sorted({w for r in restores for w in r[case]["wrong"]})[:5],
            "bytes_read_all_ranks": read,
            "bytes_received_all_ranks": sum(r[case]["bytes_received"] for r in restores),
            "read_over_checkpoint": round(read / sizes[src], 4),
            "index_files_read_all_ranks": sum(r[case]["index_files"] for r in restores),
        }
    return out


def checkpoint_bytes(storage_url: str, opts: dict[str, Any]) -> dict[str, int]:
    """Stored chunk bytes of each layout's checkpoint (what a restore of all of it needs)."""
    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.storage import open_storage

    out = {}
    for layout in ("fsdp2", "ddp"):
        m = load_manifest(open_storage(f"{storage_url}/{layout}", **opts), 1)
        out[layout] = sum(c.length for leaf in m.leaves.values() if leaf.kind != "object" for c in leaf.chunks)
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# {doc['nproc']} ranks on one machine, {doc['date']}", "", f"`{doc['command']}`", ""]
    lines += [f"commit_group_ranks {doc.get('group_ranks', 128)}", ""]
    for root, res in doc["roots"].items():
        lines += [f"## {root}", "", "| case | figures |", "|---|---|"]
        for case, fig in res.items():
            lines.append(
                f"| {case} | {', '.join(f'{k} {v}' for k, v in fig.items() if k != 'store_round_trips_by_call')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=16)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", help="output file stem (default ranks16-<date>)")
    ap.add_argument("--no-s3", action="store_true", help="local disk only")
    ap.add_argument("--group-ranks", type=int, default=128, help="commit_group_ranks of the saves (4: four groups)")
    args = ap.parse_args(argv)
    os.environ["RANKS16_GROUP_RANKS"] = str(args.group_ranks)
    doc: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/ranks16.py", *(argv if argv is not None else sys.argv[1:])]),
        "nproc": args.nproc,
        "group_ranks": args.group_ranks,
        "roots": {},
    }
    ok = True
    with tempfile.TemporaryDirectory(prefix="ranks16-") as tmp:
        t = Path(tmp)
        (t / "out").mkdir()
        root = str(t / "root")
        saves = phase(args.nproc, "save", root, {}, t / "out")
        restores = phase(args.nproc, "restore", root, {}, t / "out")
        doc["roots"]["local disk"] = summarize(saves, restores, checkpoint_bytes(root, {}))
        if not args.no_s3:
            os.environ.update(AWS)
            proc, url = start_moto(t / "moto.log")
            try:
                with FaultProxy(url) as proxy:
                    import s3fs

                    s3fs.S3FileSystem(client_kwargs={"endpoint_url": url}).mkdir("bench")
                    opts = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
                    (t / "out-s3").mkdir()
                    before = Counter(proxy.by_method)
                    saves = phase(args.nproc, "save", "s3://bench/run", opts, t / "out-s3")
                    after_save = Counter(proxy.by_method)
                    restores = phase(args.nproc, "restore", "s3://bench/run", opts, t / "out-s3")
                    after_restore = Counter(proxy.by_method)
                    res = summarize(saves, restores, checkpoint_bytes("s3://bench/run", opts))
                    res["requests"] = {
                        "save (both layouts, one launch)": dict(after_save - before),
                        "restore (4 restores, one launch)": dict(after_restore - after_save),
                    }
                    doc["roots"]["S3 (moto, through a counting proxy)"] = res
            finally:
                proc.terminate()
                proc.wait(10)
    for res in doc["roots"].values():
        ok &= all(fig.get("bit_exact", True) for fig in res.values())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"ranks16-{_dt.date.today().isoformat()}"
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
