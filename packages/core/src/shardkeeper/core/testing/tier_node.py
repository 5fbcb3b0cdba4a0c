"""One simulated node's process in the tier campaign (``tier_campaign``): forked from the
campaign (torch imported once), it joins a gloo group of the launch's ranks, one rank per
node, each with its own local directory, restores the newest step into a zeroed state, says
what it restored, then saves the launch's steps until it is killed (the victim's local
storage SIGKILLs it at the trial's kill point, or the campaign does) or they are done."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from shardkeeper.core.testing.crash_trainer import rank_state
from shardkeeper.core.testing.kill_points import KillingStorage, kill_self

#: The manager options of the campaign's nodes; ``manager_options`` override them.
NODE_DEFAULTS: dict[str, Any] = {"persist_every": 2, "local_keep": 2, "keep_last": 2, "commit_timeout_s": 30.0}


@dataclass
class Launch:
    """What every process of one launch does: restore, then save ``steps`` steps (0: restore
    only). ``versions``: step -> the launch that saved it last (the state of a step differs
    between the attempts that saved it, so bytes of an earlier, uncommitted attempt, parity
    included, never pass for the committed one)."""

    index: int
    root: str
    storage_options: dict[str, Any]
    nodes: list[str]
    erasure: tuple[int, int]
    port: int
    steps: int
    tensor_bytes: int
    versions: dict[int, int]
    victim: int = -1
    point: str = ""
    n: int = 0
    after_bytes: int = 0
    async_save: bool = False
    manager_options: dict[str, Any] = field(default_factory=dict)


def node_state(step: int, version: int, rank: int, tensor_bytes: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step`` in launch ``version``: replicated tensors (the same on
    every rank), its own and one the same at every step (with ``incremental=True``, later
    steps point at the file that holds it; both saved as ``PerRank``), and the step."""
    import torch

    g = torch.Generator().manual_seed(rank)  # (odd ranks: empty, so that only some nodes' files are pointed at)
    frozen = torch.randn(max(1, tensor_bytes // 16) if rank % 2 == 0 else 0, generator=g)
    return {**rank_state(step * 100_003 + version, rank, tensor_bytes), "frozen": frozen, "step": step}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import torch

    return (
        got["step"] == want["step"]
        and all(torch.equal(got[k].value, want[k]) for k in ("own", "frozen"))
        and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    )


def _say(wfd: int, line: str) -> None:
    os.write(wfd, (line.replace("\n", " ") + "\n").encode())


def run_node(launch: Launch, rank: int, wfd: int) -> None:
    """Rank ``rank`` of ``launch``: writes ``R{json}`` once restored (the step, its tier, the
    bytes read from the persistent root, whether it is bit for bit the state saved, the steps
    newer than it ``steps()`` still lists), then each step whose save it saw committed, a line
    each."""
    import torch
    import torch.distributed as dist

    from shardkeeper.core import CheckpointManager, PerRank
    from shardkeeper.core.errors import CheckpointNotFoundError
    from shardkeeper.core.storage import open_storage

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{launch.port}",
        rank=rank,
        world_size=len(launch.nodes),
        timeout=timedelta(seconds=60),
    )
    local = KillingStorage(open_storage(launch.nodes[rank]), "", 0, launch.after_bytes)  # armed for the saves
    opts = {**NODE_DEFAULTS, "async_save": launch.async_save, **launch.manager_options}
    mgr = CheckpointManager(
        launch.root, storage_options=launch.storage_options, local=local, erasure=launch.erasure, **opts
    )
    blank = node_state(0, 0, rank, launch.tensor_bytes)
    got: dict[str, Any] = {k: PerRank(torch.zeros_like(blank[k])) for k in ("own", "frozen")}
    got.update(model={k: torch.zeros_like(v) for k, v in blank["model"].items()}, step=-1)
    try:
        restored: int | None = mgr.restore(got)
    except CheckpointNotFoundError:
        restored = None
    exact = False
    if restored is not None:
        want = node_state(restored, launch.versions.get(restored, -1), rank, launch.tensor_bytes)
        exact = _equal(got, want)
    report = {"restored": restored, "tier": mgr.last_restore_tier, "persistent_reads": mgr.persistent_reads}
    newer = [x for x in mgr.steps() if restored is None or x > restored]  # listed after the restore: none
    _say(wfd, "R" + json.dumps({**report, "exact": exact, "newer": newer}))
    first = 1 if restored is None else restored + 1
    if rank == launch.victim:
        local.point, local.n = launch.point, launch.n
    for i, step in enumerate(range(first, first + launch.steps)):
        state = node_state(step, launch.index, rank, launch.tensor_bytes)
        if rank == launch.victim and launch.point == "staging" and i == launch.n - 1:
            threading.Timer(random.uniform(0.0, 0.003), kill_self).start()
        mgr.save(step, {**state, "own": PerRank(state["own"]), "frozen": PerRank(state["frozen"])}).wait()
        _say(wfd, str(step))
    mgr.close()
    dist.destroy_process_group()


def fork_node(launch: Launch, rank: int, log_path: str, seed: int) -> tuple[int, int]:
    """Fork rank ``rank`` of ``launch``, its output to ``log_path``; returns its pid and the
    read end of its pipe (``run_node``'s lines, and ``!`` and its error if it fails)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the node's process
        code = 0
        try:
            os.close(rfd)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
            random.seed(seed * 7919 + launch.index * 31 + rank)
            run_node(launch, rank, wfd)
        except BaseException as e:
            traceback.print_exc()
            with contextlib.suppress(OSError):  # the campaign reports it with the trial
                _say(wfd, f"!{type(e).__name__}: {e}")
            code = 3
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code)
    os.close(wfd)
    return pid, rfd


__all__ = ["NODE_DEFAULTS", "Launch", "fork_node", "node_state", "run_node"]
