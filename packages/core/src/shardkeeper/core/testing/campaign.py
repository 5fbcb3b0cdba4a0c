"""The kill -9 campaign: kill a writer at random points of a save, then check what survived.

``python -m shardkeeper.core.testing.campaign ROOT --trials 50 --seed 1`` (ROOT: a path or
an ``s3://`` / ``gs://`` URL; ``--storage-options JSON`` for the store) prints a JSON summary.
Each trial forks a writer from this process (torch is imported once), which saves a
deterministic state (a function of the step) for a few successive steps with retention
(``keep_last=2`` unless ``--manager-options`` says otherwise), the way a restarted job
continues from the newest committed step. The
writer dies by SIGKILL at a point the parent drew with a seeded RNG:

=====================  ====================================================================
``staging``            a timer fires while ``save()`` plans and copies the state
``open_writer``        when the Nth data file is created
``mid_write``          inside a data-file write, after N bytes of the file went through
                       (on S3 with a file larger than one part: mid multipart upload)
``close``              when the Nth data file is being completed
``before_manifest``    all data written, the manifest not yet (between data and commit)
``after_manifest``     the manifest written, before the caller heard of it (LATEST, retention)
``retention``          at the Nth delete of retention
``random_time``        the parent kills it after a random delay, wherever it is
=====================  ====================================================================

After each kill the parent checks, on the store: only committed steps are listed and each
verifies clean; the newest committed step is at least the last one the writer saw committed
(nothing acknowledged is lost) and restores bit for bit to its state; ``collect_garbage`` with
``min_age_s=0`` removes every uncommitted leftover and leaves the committed steps intact.
Every check reports what it finds in the summary and none raises, damage included
(``trial_checks``). ``run_campaign`` also takes a ``Storage`` object. A SIGKILL leaves the page
cache alive, so a lying ``fsync`` on a POSIX file system passes; a storage that drops what it
acknowledged (``FaultyStorage(..., lose=...)``) shows what a power cut would
(docs/reliability.md). The kill points are in ``kill_points``, the writers' manager options
in ``writer_options``, the forked writer in ``trial_writer``. ``--local DIR --erasure K,M
--nodes N`` runs it on N simulated nodes of an erasure-coded tier instead (``tier_campaign``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.testing.kill_points import KILL_POINTS, KillingStorage, check_points
from shardkeeper.core.testing.trial_checks import (
    Summary,
    blank_like,
    check_persistent,
    checked,
    deterministic_state,
    verify_all,
)
from shardkeeper.core.testing.trial_writer import Trial, fork_writer, kill_quietly, read_until_exit, record_exit
from shardkeeper.core.testing.writer_options import check_manager_options

if TYPE_CHECKING:
    from shardkeeper.core.storage.base import Storage

_blank_like = blank_like  # the name callers import


def _draw(rng: random.Random, index: int, first_step: int, points: Sequence[str], tensor_bytes: int) -> Trial:
    steps = rng.randint(1, 3)
    point = points[index % len(points)] if index < len(points) else rng.choice(points)
    n = rng.randint(1, steps)
    return Trial(
        index=index,
        point=point,
        n=n,
        after_bytes=rng.randint(1, max(1, tensor_bytes)),
        delay_s=rng.uniform(0.0, 1.0),
        first_step=first_step,
        steps=steps,
        async_save=rng.random() < 0.5,
    )


def _multipart_uploads(storage: Any) -> list[dict[str, Any]]:
    """The incomplete multipart uploads under the root; none where the backend has none."""
    from shardkeeper.core.lifecycle.gc import list_incomplete_uploads

    try:
        return list_incomplete_uploads(storage)
    except (ImportError, AttributeError, NotImplementedError):
        return []


def _check(
    storage: Any, t: Trial, acked: list[int], tensor_bytes: int, s: Summary, tier: tuple[Any, ...] | None = None
) -> int:
    """Check the store after a trial; returns the step the next trial starts at. ``tier``:
    (root, storage options, local) when ``storage`` is a local tier, whose newest step is
    restored as the restarted job would (a manager refuses a node's directory as its root).
    Every check records what it finds in ``s``; none raises (``checked``)."""
    from shardkeeper.core.commit.committed import committed_steps, step_dirs
    from shardkeeper.core.lifecycle.gc import collect_garbage

    where = _where(t)
    attempted_max = t.first_step + t.steps - 1
    committed = checked(s, where, "the committed steps could not be listed", lambda: committed_steps(storage), None)
    if committed is None:
        return attempted_max + 1  # the next trial's steps stay clear of whatever is there
    if any(c > attempted_max for c in committed):
        s.failures.append(f"{where}: a step never saved is listed: {committed}")
    if acked and (not committed or committed[-1] < acked[-1]):
        s.failures.append(f"{where}: step {acked[-1]} was acknowledged but the newest committed is {committed}")
    verify_all(storage, committed, where, s)
    if committed:
        newest = committed[-1]
        exact = checked(
            s,
            where,
            f"step {newest} did not restore",
            lambda: _restores_exactly(storage, newest, tensor_bytes, tier),
            None,
        )
        if exact:
            s.restores_bit_exact += 1
        elif exact is not None:
            s.failures.append(f"{where}: step {newest} did not restore bit for bit")
    # the writer is dead: nothing it left is young
    report = checked(
        s, where, "gc failed", lambda: collect_garbage(storage, min_age_s=0.0, no_running_saves=True), None
    )
    if report is not None:
        s.leftovers_removed += len(report.removed_paths)
        s.incomplete_uploads_aborted += len(getattr(report, "aborted_uploads", []))
    after = checked(
        s, where, "the committed steps could not be listed after gc", lambda: committed_steps(storage), None
    )
    if after is None:
        return (committed[-1] if committed else attempted_max) + 1
    if after != committed:
        s.failures.append(f"{where}: gc changed the committed steps {committed} -> {after}")
    dirs = checked(s, where, "the step directories could not be listed", lambda: step_dirs(storage), None)
    left = sorted(set(dirs or ()) - set(after))
    if left:
        s.failures.append(f"{where}: gc left uncommitted step directories {left}")
    if checked(s, where, "incomplete uploads could not be listed", lambda: _multipart_uploads(storage), None):
        s.failures.append(f"{where}: incomplete multipart uploads survive gc")
    return (after[-1] + 1) if after else 0


def _where(t: Trial) -> str:
    return f"trial {t.index} (kill point {t.point}, n={t.n})"


def _restores_exactly(storage: Any, step: int, tensor_bytes: int, tier: tuple[Any, ...] | None) -> bool:
    """Whether ``step`` restores bit for bit to its state (raises what the restore raises)."""
    import torch

    from shardkeeper.core.manager.manager import CheckpointManager

    want = deterministic_state(step, tensor_bytes)
    got = blank_like(want)
    reader = (
        CheckpointManager(storage)
        if tier is None
        else CheckpointManager(tier[0], storage_options=tier[1], local=tier[2])
    )
    with reader as mgr:
        restored = mgr.restore(got)
    return (
        restored == step
        and got["step"] == step
        and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    )


def run_campaign(
    root: str | os.PathLike[str] | Storage,
    *,
    trials: int = 20,
    seed: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    tensor_bytes: int = 1 << 20,
    points: Sequence[str] = KILL_POINTS,
    manager_options: Mapping[str, Any] | None = None,
    trial_timeout_s: float = 120.0,
    local: str | None = None,
) -> Summary:
    """Run ``trials`` kill trials against ``root``; the returned summary lists any failure
    (every check of a trial reports what it finds, none raises). ``root``: a path, a URL, or a
    ``Storage`` object (your backend, or a wrapper such as ``storage.faults.FaultyStorage``),
    which every forked writer and every check use as it is (``storage_options`` must then be
    empty: open it with them). ``local``: a local tier's directory (docs/tiers.md): the kills
    land there, ``root`` is the persistent tier (every other step uploaded), and both are
    checked after each trial."""
    import torch

    from shardkeeper.core.storage import open_storage

    torch.set_num_threads(1)
    check_points(points)
    options = dict(storage_options or {})
    opened = not isinstance(root, (str, os.PathLike))
    if opened and options:
        raise ValueError(
            f"storage_options {sorted(options)} apply to a path or URL; {root!r} is a storage already "
            f"opened: open it with them, or pass its path or URL"
        )
    url = root.url if not isinstance(root, (str, os.PathLike)) else os.fspath(root)
    mopts = check_manager_options(manager_options, local, url)
    persistent = open_storage(root, **options)
    storage = open_storage(local) if local is not None else persistent
    rng = random.Random(seed)
    s = Summary(root=url, seed=seed)
    t0 = time.monotonic()
    next_step = 0
    typical_s = 0.2  # seconds a writer lives, a moving average (random_time kills land within it)
    for i in range(trials):
        t = _draw(rng, i, next_step, points, tensor_bytes)
        s.trials += 1
        s.points[t.point] += 1
        pid, rfd = fork_writer(root, options, mopts, t, tensor_bytes, local, seed)
        started = time.monotonic()
        if t.point == "random_time":  # a fraction of how long a trial's writer typically lives
            threading.Timer(t.delay_s * typical_s, lambda p=pid: kill_quietly(p)).start()
        lines, status = read_until_exit(pid, rfd, trial_timeout_s, t, s)
        lived = time.monotonic() - started
        acked = [int(x) for x in lines if x and not x.startswith("!")]
        s.commits_acknowledged += len(acked)
        if record_exit(s, t, status, [x[1:] for x in lines if x.startswith("!")]):
            typical_s = 0.5 * typical_s + 0.5 * lived  # how long a whole writer run takes
        tier = (root, options, local) if local is not None else None
        next_step = _check(storage, t, acked, tensor_bytes, s, tier)
        if local is not None:
            check_persistent(persistent, _where(t), s)
    s.seconds = time.monotonic() - t0
    return s


def _tier_campaign(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--erasure``: the campaign on simulated nodes (``tier_campaign``)."""
    from shardkeeper.core.testing.tier_campaign import TIER_POINTS, parse_erasure, run_tier_campaign

    if a.local is None:
        p.error("--erasure needs --local DIR: the nodes' directories go under it")
    try:
        summary = run_tier_campaign(
            a.root, a.local, nodes=a.nodes, erasure=parse_erasure(a.erasure), trials=a.trials, seed=a.seed,
            tensor_bytes=a.tensor_bytes, manager_options=json.loads(a.manager_options),
            points=TIER_POINTS if a.points == ",".join(KILL_POINTS) else a.points.split(","),
            storage_options=json.loads(a.storage_options),
        )  # fmt: skip
    except ValueError as e:  # (a JSON error is one)
        p.error(str(e))
    json.dump(summary.to_json(), sys.stdout, indent=2)
    print()
    return 1 if summary.failures or summary.writer_errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardkeeper.core.testing.campaign", description=__doc__.split("\n")[0])
    p.add_argument("root", help="checkpoint root to torture (a path or URL); it should be empty")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-bytes", type=int, default=1 << 20, help="bytes of state per step")
    p.add_argument("--points", default=",".join(KILL_POINTS), help="comma-separated kill points")
    p.add_argument("--storage-options", default="{}", help="JSON: fsspec storage options")
    p.add_argument("--manager-options", default="{}", help="JSON: CheckpointManager options")
    p.add_argument("--local", metavar="DIR", help="a local tier's directory: kill there, ROOT is the persistent tier")
    p.add_argument("--erasure", metavar="K,M", help="with --local: N simulated nodes under DIR (tier_campaign)")
    p.add_argument("--nodes", type=int, default=4, help="with --erasure: the simulated nodes, one process each")
    a = p.parse_args(argv)
    if a.erasure is not None:
        return _tier_campaign(p, a)
    try:
        manager_options = json.loads(a.manager_options)
        storage_options = json.loads(a.storage_options)
    except json.JSONDecodeError as e:
        p.error(f"--manager-options and --storage-options take JSON objects: {e}")
    try:  # what cannot run is said before any writer starts
        check_points(a.points.split(","))
        check_manager_options(manager_options, a.local, a.root)
        if not isinstance(storage_options, dict):
            raise ValueError(f"--storage-options must be a JSON object of fsspec options, not {storage_options!r}")
        from shardkeeper.core.storage import open_storage

        open_storage(a.root, **storage_options)
    except (ValueError, TypeError, CheckpointError) as e:
        p.error(str(e))
    summary = run_campaign(
        a.root,
        trials=a.trials,
        seed=a.seed,
        tensor_bytes=a.tensor_bytes,
        points=a.points.split(","),
        storage_options=storage_options,
        manager_options=manager_options,
        local=a.local,
    )
    json.dump(summary.to_json(), sys.stdout, indent=2)
    print()
    return 1 if summary.failures or summary.writer_errors else 0


__all__ = ["KILL_POINTS", "KillingStorage", "Summary", "Trial", "deterministic_state", "main", "run_campaign"]


if __name__ == "__main__":
    raise SystemExit(main())
