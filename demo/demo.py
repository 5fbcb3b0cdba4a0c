"""shardkeeper demo: train with FSDP2 on 2 processes, get killed mid-run, resume at world
size 1 and 3, and show that the restored state is the saved one, bit for bit.

    python3 -m nox -s demo          # or: python demo/demo.py [--workdir DIR]

Exits non-zero if any resume differs from what was saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run(cmd: list[str], *, expect_ok: bool = True, timeout_s: float = 300) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if (
            line.startswith("[world")
            or not expect_ok
            and "SIGKILL" in line
            or line.startswith(("STEP", "step-", " ", "ok", "committed", "removed", "would"))
        ):
            print("  " + line)
    if expect_ok and proc.returncode != 0:
        print(proc.stdout[-3000:])
        raise SystemExit(f"command failed with exit code {proc.returncode}")
    return proc.returncode


def torchrun(nproc: int, *args: str, expect_ok: bool = True) -> int:
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "train.py"),
            *args,
        ],
        expect_ok=expect_ok,
    )


def cli(*args: str) -> None:
    run([sys.executable, "-m", "shardkeeper.core.cli", *args], expect_ok=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="demo-run")
    args = ap.parse_args()
    work = Path(args.workdir).absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = work / "ckpt"

    banner("1. train a small transformer with FSDP2 on 2 processes; async save every 5 steps; rank 0 dies at step 25")
    code = torchrun(2, "--root", str(root), "--steps", "40", "--save-every", "5", "--die-at", "25", expect_ok=False)
    print(f"  the job exited with code {code} (killed mid-run)")

    banner("2. what is on disk: only committed steps are visible; the save in flight never became one")
    cli("ls", str(root))

    banner("3. resume in ONE process, no process group, plain module (FSDP2 -> plain, world 2 -> 1)")
    run([sys.executable, str(HERE / "train.py"), "--root", str(root), "--resume-only"])

    banner("4. resume with FSDP2 on 3 processes (world 2 -> 3, uneven shards)")
    torchrun(3, "--root", str(root), "--resume-only")

    banner("5. compare: the state saved at the resumed step vs what each resume restored")
    events = [json.loads(line) for line in (work / "fingerprints.jsonl").read_text().splitlines()]
    saved = {e["step"]: e["fingerprint"] for e in events if e["event"] == "saved"}
    restored = [e for e in events if e["event"] == "restored"]
    ok = bool(restored)
    print(f"  {'resume':<22}{'step':>6}  {'saved fingerprint':<18}  {'restored fingerprint':<20}  result")
    for e in restored:
        same = saved.get(e["step"]) == e["fingerprint"]
        ok = ok and same
        print(
            f"  {'world size ' + str(e['world']):<22}{e['step']:>6}  {saved.get(e['step'], '?'):<18}  {e['fingerprint']:<20}  {'IDENTICAL' if same else 'DIFFERENT'}"
        )

    banner("6. verify every committed step's bytes, then clean up what the killed save left behind")
    cli("verify", str(root))
    cli("gc", str(root), "--min-age-s", "0")
    cli("ls", str(root))

    if not ok:
        raise SystemExit("FAIL: a resume did not restore the saved state")
    print("\nPASS: parameters and AdamW state restored bit for bit at world sizes 1 and 3.")


if __name__ == "__main__":
    main()
