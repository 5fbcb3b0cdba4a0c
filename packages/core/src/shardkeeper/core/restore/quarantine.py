"""After a restore of the newest step fell back past damaged steps: the coordinator
quarantines them (``lifecycle/quarantine.py``), so that the run can save those steps again, and every
rank hears what it did.

A collective of the restore's ranks, which agreed on the damaged steps (their verdicts were
agreed). The files each rank's errors named are gathered to the coordinator over the
restore's gloo group (``restore_share.PeerGroup``; JSON as uint8 tensors, no pickle): damage
one rank alone read (its own shard) is verified too. The coordinator verifies and moves each
step; what it did (where each manifest went and what was found, or why a step was left as it
is) is broadcast over the coordinator, which also keeps every rank from saving before the
manifests are gone, and every rank warns alike. Quarantine never fails the restore: the older
step is restored; a step that was not quarantined stays as it was, and the warning says why.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import torch

from shardkeeper.core.commit.protocol import COORDINATOR
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.lifecycle.quarantine import MAX_NAMED, quarantine_damaged
from shardkeeper.core.restore.share import peer_group

log = logging.getLogger(__name__)

#: Named instead of files where the damage lies in no one file (a logical mismatch: the step's
#: chunks do not form the tensors its manifest records): the whole step is verified, its
#: logical digests too (``delete_damaged.judge_damaged``).
WHOLE_STEP = "*"


def quarantine_passed_over(ctx: Any, named: dict[int, list[str]], *, stacklevel: int) -> list[int]:
    """Collective (``ctx``: the manager's ``ManagerContext``): quarantine the damaged steps
    ``named`` (step -> the files this rank's errors named), warning on every rank with what
    was done (``stacklevel``: of the warnings, from the caller of this function). Returns the
    steps quarantined (the same on every rank)."""
    if ctx.world_size > 1:
        named = _gathered(ctx, named)
    said = ""
    if ctx.rank == COORDINATOR:
        said = json.dumps([_quarantine(ctx, s, named[s]) for s in sorted(named, reverse=True)])
    if ctx.world_size > 1:
        said = ctx.coord.agree_text(said)
    url = ctx.storage.url
    done: list[int] = []
    for entry in json.loads(said or "[]"):
        s = entry["step"]
        if entry.get("path"):
            done.append(s)
            msg = (
                f"step {s} under {url} is damaged ({'; '.join(entry['damage'][:2])}) and was quarantined, so that "
                f"the run saves step {s} again: its manifest was moved to {entry['path']}, and its files stay in "
                f"{entry['dir']} until `shardkeeper gc` removes them (`shardkeeper verify {url} {s} --quarantined` "
                f"checks them)"
            )
        else:
            msg = (
                f"step {s} under {url} was not quarantined: {entry['why']}. A save of step {s} is refused while "
                f"its manifest is there: check it with `shardkeeper verify {url} {s}`, and if it is damaged "
                f"`shardkeeper delete {url} {s} --damaged` removes it"
            )
        log.warning("rank %d: %s", ctx.rank, msg)
        warnings.warn(msg, stacklevel=stacklevel + 1)
    return done


def _quarantine(ctx: Any, step: int, files: list[str]) -> dict[str, Any]:
    """The coordinator's quarantine of ``step``, as every rank hears it (never raises: the
    other ranks wait for it)."""
    storage = ctx.storage
    try:
        done = quarantine_damaged(
            storage,
            step,
            read_storage=ctx.read_storage,
            files=None if WHOLE_STEP in files else files,
            catalog=ctx.settings.catalog,
        )
    except Exception as e:  # noqa: BLE001 - said on every rank; the restore stands
        return {"step": step, "why": f"{type(e).__name__}: {e}"}
    return {
        "step": step,
        "path": storage.describe(done.path),
        "dir": storage.describe(step_dir(step)),
        "damage": done.damage,
    }


def _gathered(ctx: Any, mine: dict[int, list[str]]) -> dict[int, list[str]]:
    """Every rank's named files, merged by step (the same steps on every rank)."""
    group = peer_group(ctx.coord, ctx.settings.commit_timeout_s)
    where = f"rank {ctx.rank}: the files found damaged in step(s) {', '.join(map(str, sorted(mine)))}"
    data = json.dumps({str(s): f[:MAX_NAMED] for s, f in mine.items()}).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    group.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), where)
    width = max(1, *(int(n.item()) for n in sizes))
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros(width, dtype=torch.uint8) for _ in range(ctx.world_size)]
    group.all_gather(out, buf, where)
    merged: dict[int, list[str]] = {s: [] for s in mine}
    for t, n in zip(out, sizes):
        doc = json.loads(t[: int(n.item())].numpy().tobytes())
        for s, files in doc.items():
            got = merged.setdefault(int(s), [])
            got.extend(f for f in files if isinstance(f, str) and f not in got)
    return merged


__all__ = ["quarantine_passed_over"]
