"""The crash trial: a trainer SIGKILLed right after ``save()`` returns, then a fresh trainer.

``python -m shardkeeper.core.testing.crash_trial DIR --ranks 1,4 --trials 20`` prints a JSON
summary (``--markdown FILE`` also writes it as a table). Each trial launches N ranks (torchrun
``--standalone``, gloo, a free port; one rank runs alone), each saving a deterministic state of
its step and rank (``crash_trainer.rank_state``) for steps 1..K back to back with
``writer="process"`` (``--writer thread`` for the contrast); one rank's trainer SIGKILLs itself
right after the ``save()`` of step K returned on every rank (it polls their records every
millisecond; ``--kill-after own``: right after its own returned), and torchrun tears the
others down. The victim and
K vary across trials (every pair of a rank and a K of ``--steps``, default 1,2,3, in an order
the seed shuffles; K=1 kills right after the save that started the persist processes). Then a fresh launch of N ranks restores at once, and the trial checks:

- every rank's ``latest_step()`` is K (a save whose ``save()`` returned on every rank commits
  although its trainer died) and the restore of it equals the state bit for bit;
- every persist process the trainers used (their pids, recorded by each rank after each
  ``save()``) has ended, and no in-flight lock file is left (``SHARDKEEPER_PERSIST_LOCKS`` is
  set to a directory of the trial's own).

A trial where a surviving rank was torn down before its own ``save()`` of K returned (with
``--kill-after own``) is outside that guarantee: it is counted (``not_returned_everywhere``) and checked only for a clean,
bit-exact restore. With ``writer="thread"`` the save dies with its trainer: lost steps are
counted, not failures. DIR holds one folder per trial, removed when the trial passed
(``--keep`` keeps them); a failing trial's launch logs stay there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardkeeper.core.testing.crash_summary import CrashSummary, TrialResult, to_markdown
from shardkeeper.core.testing.procs import kill_tree, signal_all

TRAINER = "shardkeeper.core.testing.crash_trainer"


def _launch(ranks: int, args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[int, float]:
    """Run the trainer on ``ranks`` ranks, its output to ``log``: its exit status and seconds.
    The launch's own exit is timed, not that of the persist processes it leaves."""
    entry = ["-m", TRAINER, *args]
    if ranks > 1:
        entry = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *entry]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *entry], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc, dump_stacks=True)
            code = 124
    return code, time.monotonic() - t0


def _persist_alive(pid: int) -> bool:
    """Whether ``pid`` is a persist process still running (an exited, unreaped one is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return b"shardkeeper.core.persist.worker" in cmd and state not in ("Z", "X")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _tail(log: Path, n: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-n:].replace("\n", " | ")
    except OSError:
        return "(no log)"


def _committed(root: Path) -> list[int]:
    from shardkeeper.core.commit.committed import committed_steps
    from shardkeeper.core.storage import open_storage

    try:
        return list(committed_steps(open_storage(str(root))))
    except Exception:
        return []


def _check_saves(r: TrialResult, ranks: int, out: Path, code: int, log: Path) -> None:
    """What the killed launch left: each rank's record of the saves whose ``save()`` returned."""
    where = f"trial {r.index} (victim rank {r.victim}, step {r.step})"
    records = [_read_json(out / f"save.r{k}.json") or {} for k in range(ranks)]
    for rec in records:
        r.persist_pids += [p for p in rec.get("persist_pids", []) if p not in r.persist_pids]
    returned = [r.step in rec.get("returned", []) for rec in records]
    r.returned_everywhere = all(returned)
    if code == 0:
        r.failures.append(f"{where}: the save launch exited 0: the victim was not killed")
    elif code == 124:
        r.failures.append(f"{where}: the save launch timed out; log: {_tail(log)}")
    elif not returned[r.victim]:
        r.failures.append(f"{where}: the victim's save() of step {r.step} never returned; log: {_tail(log)}")


def _check_restore(r: TrialResult, ranks: int, out: Path, code: int, log: Path, writer: str) -> None:
    """The fresh trainer's view: every rank restored step K (or, outside the guarantee, a step
    before it) bit for bit."""
    where = f"trial {r.index} (victim rank {r.victim}, step {r.step})"
    results = [_read_json(out / f"restore.r{k}.json") for k in range(ranks)]
    if code != 0 or any(x is None for x in results):
        r.failures.append(f"{where}: the restore launch failed (exit status {code}); log: {_tail(log)}")
        return
    r.latest = [x.get("latest") for x in results if x is not None]
    r.latest_wait_s = max(float(x.get("latest_wait_s", 0.0)) for x in results if x is not None)
    for x in results:
        assert x is not None
        if "error" in x:
            r.failures.append(f"{where}: rank {x['rank']}: the restore failed: {x['error']}")
        elif x.get("latest") is not None and not (x.get("exact") and x.get("restored") == x["latest"]):
            r.failures.append(f"{where}: rank {x['rank']}: step {x['latest']} did not restore bit for bit")
    if len(set(r.latest)) > 1:
        r.failures.append(f"{where}: the ranks disagree on the newest step: {r.latest}")
    r.committed_restored = not r.failures and r.latest == [r.step] * ranks
    if r.returned_everywhere and not r.committed_restored and writer == "process" and not r.failures:
        r.failures.append(
            f"{where}: save() of step {r.step} returned on every rank but the fresh trainer's newest step "
            f"is {r.latest}: the save was lost"
        )


def _end(pids: list[int]) -> None:
    """SIGABRT, on which each prints its threads' stacks (faulthandler) to the save's log; then SIGKILL."""
    signal_all(pids, signal.SIGABRT)
    time.sleep(2.0)
    signal_all([p for p in pids if _persist_alive(p)], signal.SIGKILL)


def _check_leftovers(r: TrialResult, locks: Path, grace_s: float) -> None:
    """No persist process outlives what it had to commit, no lock file stays (waited for up to ``grace_s``)."""
    where = f"trial {r.index} (victim rank {r.victim}, step {r.step})"
    t0 = time.monotonic()
    while any(_persist_alive(p) for p in r.persist_pids) and time.monotonic() - t0 < grace_s:
        time.sleep(0.05)
    r.persist_exit_s = time.monotonic() - t0
    r.persist_left = [p for p in r.persist_pids if _persist_alive(p)]
    if r.persist_left:
        r.failures.append(
            f"{where}: persist process(es) {r.persist_left} still run {grace_s:.0f} s after the restore (their "
            f"stacks are in save.log)"
        )
        _end(r.persist_left)  # not to disturb the next trials
    r.locks_left = sorted(p.name for p in locks.glob("*.lock")) if locks.is_dir() else []
    if r.locks_left:
        r.failures.append(f"{where}: lock file(s) left in {locks}: {r.locks_left}")


def _trial(
    workdir: Path, index: int, ranks: int, victim: int, step: int, writer: str, opts: dict[str, Any]
) -> TrialResult:
    r = TrialResult(index=index, victim=victim, step=step)
    t0 = time.monotonic()
    here = workdir / f"trial-{index:03d}"
    shutil.rmtree(here, ignore_errors=True)
    out, locks, root = here / "out", here / "locks", here / "root"
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "SHARDKEEPER_PERSIST_LOCKS": str(locks),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    size = ["--tensor-bytes", str(opts["tensor_bytes"]), "--commit-timeout", str(opts["commit_timeout_s"])]
    args = ["save", str(root), str(out), "--steps", str(step), "--victim", str(victim), "--writer", writer]
    args += ["--kill-after", opts["kill_after"], *size]
    code, r.save_launch_s = _launch(ranks, args, env, here / "save.log", opts["timeout_s"])
    _check_saves(r, ranks, out, code, here / "save.log")
    r.committed_at_save_exit = step in _committed(root)
    code, r.restore_launch_s = _launch(ranks, ["restore", str(root), str(out), *size], env, here / "restore.log", opts["timeout_s"])  # fmt: skip
    _check_restore(r, ranks, out, code, here / "restore.log", writer)
    _check_leftovers(r, locks, opts["grace_s"])
    r.trial_s = time.monotonic() - t0
    if not r.failures and not opts["keep"]:
        shutil.rmtree(here, ignore_errors=True)
    return r


def check_options(ranks: int, trials: int, writer: str, steps: Sequence[int], tensor_bytes: int) -> None:
    """A ``ValueError`` naming what a crash trial cannot run with, before any launch."""
    if ranks < 1 or trials < 0 or not steps or min(steps) < 1 or tensor_bytes < 64:
        raise ValueError(
            f"crash trial: ranks={ranks}, trials={trials}, steps={list(steps)}, tensor_bytes={tensor_bytes}: "
            f"ranks must be at least 1, trials at least 0, steps one or more steps from 1, tensor_bytes at least 64"
        )
    if writer not in ("process", "thread"):
        raise ValueError(f"crash trial: writer={writer!r}; choose 'process' or 'thread'")


def run_crash_trials(
    workdir: str | os.PathLike[str],
    *,
    ranks: int = 1,
    trials: int = 20,
    seed: int = 0,
    writer: str = "process",
    kill_after: str = "all",
    tensor_bytes: int = 2 << 20,
    steps: Sequence[int] = (1, 2, 3),
    commit_timeout_s: float = 30.0,
    trial_timeout_s: float = 300.0,
    exit_grace_s: float | None = None,
    keep: bool = False,
) -> CrashSummary:
    """Run ``trials`` crash trials at ``ranks`` ranks under ``workdir`` (module doc); the
    summary lists every failure (none raises). ``commit_timeout_s``: the managers' (the fresh
    trainer waits up to ``2 * commit_timeout_s + 30`` s for an earlier trainer's commit, then
    fails naming it); ``trial_timeout_s`` bounds each launch; ``exit_grace_s`` is how long the
    persist processes may take to end after the restore (None: as long as a rank's wait for
    an outcome, ``2 * commit_timeout_s + 30``: one whose trainer died before its hand-over
    leaves the others waiting that long at most)."""
    check_options(ranks, trials, writer, steps, tensor_bytes)
    if kill_after not in ("all", "own"):
        raise ValueError(
            f"crash trial: kill_after={kill_after!r}; choose 'all' (every rank's save() returned) or 'own'"
        )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    pairs = [(v, k) for k in sorted(set(steps)) for v in range(ranks)]
    random.Random(seed).shuffle(pairs)
    opts = {
        "tensor_bytes": tensor_bytes,
        "commit_timeout_s": commit_timeout_s,
        "timeout_s": trial_timeout_s,
        "grace_s": 2 * commit_timeout_s + 30.0 if exit_grace_s is None else exit_grace_s,
        "keep": keep,
        "kill_after": kill_after,
    }
    s = CrashSummary(ranks, writer, seed, tensor_bytes, kill_after, load_before=os.getloadavg())
    t0 = time.monotonic()
    for i in range(trials):
        victim, step = pairs[i % len(pairs)]
        s.results.append(_trial(work / f"ranks{ranks}-{writer}-{kill_after}", i, ranks, victim, step, writer, opts))
    s.seconds = time.monotonic() - t0
    s.load_after = os.getloadavg()
    return s


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardkeeper.core.testing.crash_trial", description=__doc__.split("\n")[0]
    )
    p.add_argument("workdir", help="a scratch directory: one folder per trial (root, logs, lock files)")
    p.add_argument("--ranks", default="1", help="comma-separated rank counts, one run each (e.g. 1,4)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--writer", choices=("process", "thread"), default="process")
    p.add_argument("--kill-after", choices=("all", "own"), default="all", help="whose save() of K returned first")
    p.add_argument("--tensor-bytes", type=int, default=2 << 20, help="bytes of state per rank and step")
    p.add_argument("--steps", default="1,2,3", help="comma-separated steps the killed save's step is drawn from")
    p.add_argument("--commit-timeout", type=float, default=30.0, help="the managers' commit_timeout_s")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds each launch may take")
    p.add_argument("--exit-grace", type=float, help="seconds the persist processes may take to end after the restore")
    p.add_argument("--markdown", metavar="FILE", help="also write the summary as a markdown table")
    p.add_argument("--keep", action="store_true", help="keep the folders of trials that passed")
    a = p.parse_args(argv)
    try:
        counts = [int(x) for x in a.ranks.split(",")]
        steps = [int(x) for x in a.steps.split(",")]
        for n in counts:  # what cannot run is said before any launch
            check_options(n, a.trials, a.writer, steps, a.tensor_bytes)
    except ValueError as e:
        p.error(f"--ranks and --steps take comma-separated integers ({a.ranks!r}, {a.steps!r}): {e}")
    summaries = [
        run_crash_trials(
            a.workdir, ranks=n, trials=a.trials, seed=a.seed, writer=a.writer, kill_after=a.kill_after,
            tensor_bytes=a.tensor_bytes, steps=steps, commit_timeout_s=a.commit_timeout,
            trial_timeout_s=a.trial_timeout, exit_grace_s=a.exit_grace, keep=a.keep,
        )
        for n in counts
    ]  # fmt: skip
    json.dump([s.to_json() for s in summaries], sys.stdout, indent=2)
    print()
    if a.markdown:
        Path(a.markdown).write_text(to_markdown(summaries))
    return 1 if any(s.failures for s in summaries) else 0


__all__ = ["CrashSummary", "TrialResult", "check_options", "main", "run_crash_trials", "to_markdown"]


if __name__ == "__main__":
    raise SystemExit(main())
