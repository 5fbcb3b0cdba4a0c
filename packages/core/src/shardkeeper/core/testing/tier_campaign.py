"""The kill -9 campaign on the erasure-coded node tier: simulated nodes, one process each.

``python -m shardkeeper.core.testing.campaign ROOT --local DIR --erasure K,M --nodes N
--trials 30`` (or ``python -m shardkeeper.core.testing.tier_campaign``) prints a JSON summary.
Node ``i`` is a directory ``DIR/node<i>`` and one process, forked from the campaign (torch
imported once), rank ``i`` of a gloo group; ROOT is the persistent root (every other step
uploaded). Each trial is one launch of N processes, as a restarted job: each restores the
newest step, says what it restored, then saves 1-3 steps, until one node's process (drawn)
is SIGKILLed at a kill point of ``campaign`` (in its local directory, parity files
included) or at a random moment of the saves (or, ``restore``, of the restore before them:
a rebuild or a copy cut short); the others are killed soon after (a job
torn down). Then, drawn, the victim's directory is deleted (a replaced node), and at times
up to M - 1 other nodes' too: never more than M nodes lost at once. The next launch's
restore is checked against what the directories and ROOT hold:

- every rank restores the newest step with a manifest on a node left or committed at ROOT,
  never older than a step some rank saw acknowledged nor one never saved, bit for bit to the
  state the launch that saved it last wrote (each attempt at a step saves other bytes, so an
  uncommitted attempt's files or parity never pass for the committed one);
- from the local tier, with no byte read from ROOT, unless ROOT holds a newer step;
- no rank's ``steps()`` lists a step newer than the one restored (a step not whole is no
  step);
- what ROOT lists as committed verifies, and its gc leaves no uncommitted directory.

Each restore ignores what uncommitted saves left on the nodes (step directories without a
manifest, their parity). Before a last launch, which restores and saves one step, gc
removes those directories from each node (``collect_garbage``, as ``shardkeeper gc DIR``);
after it, no node may hold a step directory without a manifest nor the parity of a step
without one (the save removes the parity of the steps gone from its node).
``DIR/logs`` holds each process's output, named in the failures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardkeeper.core.testing.kill_points import KILL_POINTS, check_points
from shardkeeper.core.testing.tier_checks import (
    Expect,
    Ran,
    TierSummary,
    check_restores,
    count_end,
    gc_nodes,
    judge,
    leftovers,
)
from shardkeeper.core.testing.tier_node import Launch, fork_node
from shardkeeper.core.testing.trial_writer import kill_quietly

#: ``campaign``'s kill points, and ``restore``: the victim killed at a random moment of the
#: launch's restore (a rebuild from parity, a copy made whole; no node is then replaced).
TIER_POINTS = (*KILL_POINTS, "restore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse(rank: int, line: str, ran: Ran) -> None:
    if line.startswith("R"):
        ran.reports[rank] = json.loads(line[1:])
    elif line.startswith("!"):
        ran.said.setdefault(rank, line[1:])
    elif line.strip():
        ran.acked.add(int(line))


def launch_nodes(
    launch: Launch, logs: Path, seed: int, delay: float | None, linger_s: float, timeout_s: float, at_start: bool
) -> Ran:
    """Run ``launch``'s processes until they end: the victim is SIGKILLed ``delay`` seconds
    after every rank restored (``at_start``: after the launch began; None: only at its kill
    point), the others ``linger_s`` after the victim died; every process still running at
    ``timeout_s``."""
    world = len(launch.nodes)
    forked = [fork_node(launch, r, str(logs / f"launch{launch.index:03d}-r{r}.log"), seed) for r in range(world)]
    pids = {pid: r for r, (pid, _) in enumerate(forked)}
    fds = {fd: r for r, (_, fd) in enumerate(forked)}
    ran, bufs = Ran([None] * world, set(), {}, False, 0.0), {fd: "" for fd in fds}
    t0 = time.monotonic()
    deadline, dead_at, restored_at = t0 + timeout_s, None, None
    kill_at = t0 + delay if at_start and delay is not None else None
    while pids or fds:
        for fd in select.select(list(fds), [], [], 0.05)[0] if fds else ():
            chunk, r = os.read(fd, 65536), fds[fd]
            *lines, bufs[fd] = (bufs[fd] + chunk.decode(errors="replace")).split("\n")
            if not chunk:  # the process ended: what it wrote last, then its pipe is done
                lines.append(bufs[fd])
                fds.pop(fd)
                os.close(fd)
            for line in lines:
                _parse(r, line, ran)
        now = time.monotonic()
        if restored_at is None and all(r is not None for r in ran.reports):
            restored_at, ran.restore_s = now, now - t0
            kill_at = kill_at if at_start or delay is None else now + delay
        if kill_at is not None and now >= kill_at and launch.victim >= 0:
            kill_quietly(forked[launch.victim][0])
            kill_at = None
        for pid, r in list(pids.items()):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                pids.pop(pid)
                if dead_at is not None:  # (torn down after the first death)
                    continue
                if r == launch.victim and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                    ran.killed, dead_at = True, now
                elif not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                    ran.said.setdefault(r, f"wait status {status}")
                    dead_at = now  # a rank failed on its own: the others would wait on it
        if (dead_at is not None and now - dead_at >= linger_s) or now > deadline:
            if now > deadline:
                ran.said.setdefault(-1, f"the launch did not end in {timeout_s} s")
            for pid in pids:
                kill_quietly(pid)
            deadline = now + 3600.0
    ran.save_s = time.monotonic() - (restored_at or t0)
    return ran


def _replace(rng: random.Random, victim: int, dirs: list[Path], m: int, probability: float) -> list[int]:
    """Drawn with ``probability``: the victim's node replaced by an empty one (its directory
    deleted), with up to m - 1 others; the nodes replaced."""
    if rng.random() >= probability:
        return []
    others = [n for n in range(len(dirs)) if n != victim]
    lost = [victim, *rng.sample(others, rng.randint(0, m - 1))]
    for n in lost:
        shutil.rmtree(dirs[n], ignore_errors=True)
    return lost


def _check_options(given: Mapping[str, Any] | None) -> None:
    """A ``ValueError`` naming a manager option the nodes cannot take (before any launch)."""
    import inspect

    from shardkeeper.core import CheckpointManager

    known = set(inspect.signature(CheckpointManager).parameters) - {"root", "self"}
    for name in given or {}:
        if name in ("local", "erasure", "replicas", "storage_options") or name not in known:
            raise ValueError(
                f"manager option {name!r}: the tier campaign sets local, erasure and storage_options itself and "
                f"never replicas; other CheckpointManager keywords: {', '.join(sorted(known))}"
            )


def _draw(rng: random.Random, i: int, world: int, points: Sequence[str]) -> dict[str, Any]:
    steps = rng.randint(1, 3)
    point = points[i % len(points)] if i < len(points) else rng.choice(points)
    return {  # a node puts one manifest per save (its commit or its record), writes a few files
        "victim": rng.randrange(world),
        "point": point,
        "n": rng.randint(1, steps if point.endswith("manifest") else 2 * steps),
        "steps": steps,
        "delay": rng.uniform(0.0, 1.0),
        "linger_s": rng.uniform(0.0, 0.3),
        "async_save": rng.random() < 0.5,
    }


def run_tier_campaign(
    root: str | os.PathLike[str],
    local: str | os.PathLike[str],
    *,
    nodes: int = 4,
    erasure: tuple[int, int] = (3, 1),
    trials: int = 10,
    seed: int = 0,
    tensor_bytes: int = 256 << 10,
    points: Sequence[str] = TIER_POINTS,
    lose_probability: float = 0.5,
    manager_options: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    launch_timeout_s: float = 120.0,
) -> TierSummary:
    """Run ``trials`` kill trials of ``nodes`` simulated nodes under ``erasure`` (module doc);
    the summary lists every failure (none raises)."""
    import torch
    import torch.distributed  # noqa: F401  (imported once, before the forks, as is the manager)

    import shardkeeper.core.tiers.two_tiers  # noqa: F401
    from shardkeeper.core import CheckpointManager  # noqa: F401
    from shardkeeper.core.storage import open_storage

    torch.set_num_threads(1)
    check_points([x for x in points if x != "restore"])
    k, m = erasure
    _check_options(manager_options)
    if nodes < k + m or not 0.0 <= lose_probability <= 1.0:
        raise ValueError(f"tier campaign: nodes={nodes}, erasure={erasure}: pass nodes >= k + m and 0 <= lose <= 1")
    base = Path(local)
    dirs, logs = [base / f"node{i}" for i in range(nodes)], base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    persistent = open_storage(os.fspath(root), **dict(storage_options or {}))
    rng = random.Random(seed)
    s = TierSummary(root=os.fspath(root), seed=seed, nodes=nodes, erasure=(k, m))
    t0, typical_s, restore_s = time.monotonic(), 1.0, 1.0  # the saves' and the restores' typical seconds
    expect, attempted = Expect(None, "none"), 0
    versions: dict[int, int] = {}  # step -> the launch that saved it last
    for i in range(trials + 1):
        last = i == trials
        d = _draw(rng, i, nodes, points)
        if last:  # what the kills left uncommitted on the nodes: gc's, as docs/tiers.md says
            gc_nodes(dirs, s)
        launch = Launch(
            i, os.fspath(root), dict(storage_options or {}), [str(p) for p in dirs], (k, m), free_port(),
            1 if last else d["steps"], tensor_bytes, dict(versions), -1 if last else d["victim"], d["point"],
            d["n"], rng.randint(1, tensor_bytes // 2), d["async_save"], dict(manager_options or {}),
        )  # fmt: skip
        where = f"trial {i} (victim node {d['victim']}, kill point {d['point']}, n={d['n']})" if not last else "the last launch"  # fmt: skip
        if not last:
            s.trials += 1
            s.points[d["point"]] += 1
        timed = d["point"] in ("random_time", "restore") and not last
        delay = d["delay"] * (typical_s if d["point"] == "random_time" else restore_s) if timed else None
        ran = launch_nodes(launch, logs, seed, delay, d["linger_s"], launch_timeout_s, d["point"] == "restore")
        restore_s = 0.5 * restore_s + 0.5 * ran.restore_s if ran.restore_s else restore_s
        in_restore = ran.killed and ran.reports[d["victim"]] is None  # (nothing saved: no node replaced)
        s.killed_in_restore += in_restore
        check_restores(ran, expect, where, logs, i, s, in_restore)
        if last:
            if ran.said or len(ran.acked) != 1:
                s.failures.append(f"{where}: its save did not commit: {ran.said}")
            break
        s.commits_acknowledged += len(ran.acked)
        first = 1 if expect.step is None else expect.step + 1
        versions.update({st: i for st in range(first, first + d["steps"])})
        attempted = max(attempted, first + d["steps"] - 1)
        if count_end(s, d, ran, where):
            typical_s = 0.5 * typical_s + 0.5 * ran.save_s
        lost = [] if in_restore or not ran.killed else _replace(rng, d["victim"], dirs, m, lose_probability)
        s.nodes_replaced += len(lost)
        expect = judge(s, where, expect.step, dirs, persistent, bool(lost), ran, attempted)
    leftovers(dirs, s)
    s.seconds = time.monotonic() - t0
    return s


def parse_erasure(text: str) -> tuple[int, int]:
    """``"K,M"`` as ``(K, M)``; a ``ValueError`` naming the form otherwise."""
    try:
        k, m = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--erasure takes K,M (e.g. 3,1), not {text!r}") from None
    return k, m


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardkeeper.core.testing.tier_campaign", description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("root", help="the persistent root (a path or URL); it should be empty")
    p.add_argument("local", help="a directory for the nodes' directories and logs; it should be empty")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--erasure", default="3,1", help="K,M")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-bytes", type=int, default=256 << 10, help="bytes of state per rank and step")
    p.add_argument("--points", default=",".join(TIER_POINTS), help="comma-separated kill points")
    p.add_argument("--lose", type=float, default=0.5, help="probability that a killed node loses its directory")
    p.add_argument("--manager-options", default="{}", help="JSON: CheckpointManager options")
    a = p.parse_args(argv)
    try:
        summary = run_tier_campaign(
            a.root, a.local, nodes=a.nodes, erasure=parse_erasure(a.erasure), trials=a.trials, seed=a.seed,
            tensor_bytes=a.tensor_bytes, points=a.points.split(","), lose_probability=a.lose,
            manager_options=json.loads(a.manager_options),
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    json.dump(summary.to_json(), sys.stdout, indent=2)
    print()
    return 1 if summary.failures or summary.writer_errors else 0


__all__ = ["TIER_POINTS", "TierSummary", "free_port", "launch_nodes", "main", "parse_erasure", "run_tier_campaign"]


if __name__ == "__main__":
    raise SystemExit(main())
