"""A node's damaged copy of a local step replaced by another node's good copy, before the
restore falls back to an older step.

A restore reads each byte from one node's copy: its own, or that of the rank that read a
shared range for it. A flipped bit on one node's disk therefore fails the step for every
rank that copy served, although another node may hold the same file whole (a replica, or a
file made whole there earlier). When the ranks agree that a local step is damaged, the files
their errors name (``ChecksumMismatchError.file``) are checked on every node that holds them:
each node's leader reads its copy against the manifest's digests (``verify_step`` limited to
those files), since an error does not say whose copy the bytes came from. Each damaged copy
is removed and replaced by one that checks out, moved and verified as ``make_whole`` moves
files, and the restore reads the step again. A damaged file no node holds a good copy of is
rebuilt from parity when the tier has it (``erasure=``; its damaged copies count as lost, as
if its node's directory were gone) and then spread as any good copy; without parity that
covers it, nothing is replaced and the restore falls back as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.errors import ChecksumMismatchError
from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.transfer import Move, move_files, remove_copy
from shardkeeper.core.tiers.wire import TierGroup
from shardkeeper.core.verify.step import verify_step

log = logging.getLogger(__name__)

#: The files one rank reports per attempt (a restore stops at its first damaged chunk).
_MAX_REPORTED = 16
#: A copy's judgement: its chunks' bytes checked out; damaged; not on the node; or not
#: judged (the storage failed to read it, or a problem of the step keeps it from being checked).
GOOD, BAD, ABSENT, UNKNOWN = "good", "bad", "absent", "unknown"


#: A ``Repair``'s source when the file was rebuilt from parity rather than copied from a node.
PARITY = -1


@dataclass(frozen=True)
class Repair:
    path: str  # root-relative
    src_node: int  # PARITY: rebuilt from parity on dst_node
    dst_node: int

    def shown(self) -> str:
        how = "rebuilt from parity" if self.src_node == PARITY else f"from node {self.src_node}"
        return f"{self.path} on node {self.dst_node} {how}"


def damaged_files(error: BaseException) -> list[str]:
    """The files a restore's error (or one in its chain of causes) names as damaged."""
    out: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        path = getattr(e, "file", "")
        if isinstance(e, ChecksumMismatchError) and isinstance(path, str) and path and path not in out:
            out.append(path)
        e = e.__cause__ or e.__context__
    return out[:_MAX_REPORTED]


def check_copies(local: Any, step: int, paths: Sequence[str]) -> dict[str, list[Any]]:
    """This node's copy of each of ``paths`` (files of ``step`` or those it points at):
    ``[GOOD | BAD | ABSENT | UNKNOWN, stored size]``, judged against the manifest's digests.
    A copy is good only when bytes of it were checked and nothing was found; one the storage
    could not read, or any copy when a problem names no file, is not judged."""
    out: dict[str, list[Any]] = {p: [ABSENT, 0] for p in paths}
    here = [p for p in paths if local.raw.exists(p)]
    if not here:
        return out
    report = verify_step(local.read, step, files=here)
    judged = all(q.file for q in report.problems)
    for p in here:
        kinds = {q.kind for q in report.problems if q.file == p}
        if kinds - {"read"}:
            state = BAD
        elif kinds or not judged or p not in report.files_read:
            state = UNKNOWN
        else:
            state = GOOD
        out[p] = [state, local.raw.size(p)]
    return out


def judge_copies(group: TierGroup, nodes: NodeMap, local: Any, step: int, paths: Sequence[str], where: str) -> list[dict[str, list[Any]]]:  # fmt: skip
    """Collective: each node's copy of ``paths`` judged by its leader (``check_copies``), in
    node order, every rank alike. A failure to check is agreed on: every rank raises."""
    mine: dict[str, list[Any]] = {}
    error: BaseException | None = None
    if nodes.is_leader(group.rank):
        try:
            mine = check_copies(local, step, paths)
        except Exception as e:  # every rank hears it (agreed below): none skips a collective
            error = e
    group.agree_ok(error, f"{where}: checking each node's copy of the files")
    copies = group.all_gather_json(mine, f"{where}: each node's copies of the files")
    return [copies[nodes.leader(k)] for k in range(len(nodes.nodes))]


def repair(
    group: TierGroup,
    nodes: NodeMap,
    local: Any,
    step: int,
    reported: Sequence[str],
    rebuild: Callable[[list[str]], list[str]] | None = None,
) -> list[Repair]:
    """Collective: every node's damaged copy of the files the ranks ``reported`` replaced by
    a good copy from another node. A damaged file with no good copy anywhere is first given
    to ``rebuild`` (collective: rebuilt from parity on its node, as ``rebuild.rebuild_damaged``;
    the paths it rebuilt). Returns the repairs; none when no rank reported a file, no copy was
    found damaged, or some damaged file still has no good copy anywhere (then the step cannot
    be restored, so no copy is touched). Every local failure is agreed on, so every rank
    raises together and none waits."""
    me = group.rank
    where = f"step {step}, rank {me}"
    gathered = group.all_gather_json(list(reported)[:_MAX_REPORTED], f"{where}: the files found damaged")
    paths = sorted({p for g in gathered for p in g if isinstance(p, str)})
    if not paths:
        return []
    by_node = judge_copies(group, nodes, local, step, paths, where)
    rebuilt: list[Repair] = []
    lost = [p for p in paths if _no_good_copy(by_node, p)]
    if lost and rebuild is not None:  # (every rank alike: the same judgements)
        done = set(rebuild(lost))
        if done:
            by_node = judge_copies(group, nodes, local, step, paths, where)
            rebuilt = [Repair(p, PARITY, _holder(by_node, p)) for p in lost if p in done]
    repairs: list[Repair] = []
    plan: list[Move] = []
    for i, path in enumerate(paths):
        good = [k for k, c in enumerate(by_node) if c[path][0] == GOOD]
        bad = [k for k, c in enumerate(by_node) if c[path][0] == BAD]
        if bad and not good:  # the step cannot be made good: nothing is touched
            log.warning(
                "rank %d: step %d: no node holds a copy of %s that checks out (damaged on node(s) %s)%s; not "
                "repaired. `shardkeeper verify DIR` on each node's directory shows the damage",
                me,
                step,
                path,
                ", ".join(map(str, bad)),
                "" if rebuild is None else ", and its parity could not rebuild it",
            )
            return []
        for j, k in enumerate(bad):
            h = good[(i + j) % len(good)]
            src, dst = nodes.nodes[h], nodes.nodes[k]
            plan.append(Move(path, int(by_node[h][path][1]), src[i % len(src)], dst[i % len(dst)]))
            repairs.append(Repair(path, h, k))
    if not plan:
        if rebuilt:
            return rebuilt
        log.warning(
            "rank %d: step %d: no node's copy of %s was found damaged; nothing repaired",
            me,
            step,
            ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else ""),
        )
        return []
    _replace(group, nodes, local, step, repairs, plan, where)
    return rebuilt + repairs


def _replace(
    group: TierGroup, nodes: NodeMap, local: Any, step: int, repairs: list[Repair], plan: list[Move], where: str
) -> None:
    """Collective: the damaged copies ``repairs`` names removed from their nodes (each said),
    then the good ones moved in by ``plan``; a failure anywhere raises everywhere."""
    me = group.rank
    error: BaseException | None = None
    node = nodes.node_of(me)
    if nodes.is_leader(me):
        try:
            for r in repairs:
                if r.dst_node == node:
                    log.warning(
                        "rank %d: step %d: this node's copy of %s in %s is damaged; replacing it with node %d's copy",
                        me,
                        step,
                        r.path,
                        local.raw.url,
                        r.src_node,
                    )
                    remove_copy(local.storage, r.path)  # (through the view: its caches forget it)
        except Exception as e:
            error = e
    group.agree_ok(error, f"{where}: removing the damaged copies")
    error = None
    try:
        move_files(group, local.raw, plan, f"{where}: replacing the damaged copies")
    except Exception as e:  # this rank's own failure, or a sender's: agreed below
        error = e
    group.agree_ok(error, f"{where}: replacing the damaged copies")


def _no_good_copy(by_node: list[dict[str, list[Any]]], path: str) -> bool:
    """Whether some node's copy of ``path`` is damaged and none checks out."""
    states = [c[path][0] for c in by_node]
    return BAD in states and GOOD not in states


def _holder(by_node: list[dict[str, list[Any]]], path: str) -> int:
    """The first node whose copy of ``path`` checks out (after a rebuild: the node rebuilt)."""
    return next((k for k, c in enumerate(by_node) if c[path][0] == GOOD), PARITY)


__all__ = [
    "ABSENT",
    "BAD",
    "GOOD",
    "PARITY",
    "UNKNOWN",
    "Repair",
    "check_copies",
    "damaged_files",
    "judge_copies",
    "repair",
]
