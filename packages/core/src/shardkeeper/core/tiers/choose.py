"""Restore from the tiers: which step, from which tier, and each node's copy made whole.

Every node's leader lists its directory (each step: whether its manifest is there, and every
file with its size); rank 0 also lists which steps the persistent root holds (by listing
alone: no byte is read from it). The listings are all-gathered. A step is *whole locally*
when its manifest is on some node and every file it lists is on some node at the size it was
written; every rank that holds the manifest judges that, and the ranks agree (one
all-reduce). The newest step whole locally is restored when no newer step is persisted;
otherwise the persistent root's newest (and ``restore(step=N)`` takes N from the local tier
when it is whole there, else from the persistent root). One commit gives one manifest: two
nodes holding different manifests of a step, or a node and the persistent root (the step
written by two writers: two jobs on one root, a node directory from another history), is a
conflict, raised on every rank when the restore needs that step.

Before a local restore, each node's copy of the step is made whole: the manifest goes to the
nodes without it (one broadcast), and every file a node lacks comes from a node that has it
(``transfer.move_files``, verified on arrival; the senders and receivers spread over the
nodes' ranks). The restore then reads every byte from its own node's directory, verified
against the manifest's digests as always: a damaged copy, the node's own or one that came
from a node whose copy was damaged, is found there and repaired (``repair.repair``: from
another node's good copy, or rebuilt from parity). Copies are not checked before they are
moved: that would read every moved file twice on every restore, to spare a repair that
damage alone needs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.commit.committed import load_manifest, manifest_digest, manifest_path, manifest_steps
from shardkeeper.core.commit.files import resolve_file, walk_files
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.format.manifest import MANIFEST_NAME
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.transfer import Move, move_files, remove_copy
from shardkeeper.core.tiers.wire import TierGroup

log = logging.getLogger(__name__)

LOCAL, PERSISTENT = "local", "persistent"


@dataclass
class Choice:
    """What a tiered restore reads: ``tier`` (``LOCAL`` or ``PERSISTENT``; None: nothing is
    committed anywhere) and ``step`` (None from the persistent tier: its newest, with fallback)."""

    tier: str | None
    step: int | None
    local_steps: list[int] = field(default_factory=list)  # whole locally, newest first
    persisted: list[int] = field(default_factory=list)
    listings: list[dict[str, Any]] = field(default_factory=list)  # per node
    needs: dict[int, dict[str, tuple[int, bool]]] = field(default_factory=dict)  # what this rank read of manifests
    conflicts: list[int] = field(default_factory=list)  # steps whose manifests differ between nodes: kept
    lost_beyond_parity: list[str] = field(default_factory=list)  # notes: newer steps parity cannot rebuild


def list_node(view: Storage, storage: Storage, read: Storage) -> dict[str, Any]:
    """``{step: {"m": manifest readable, "d": its digest, "c": its created_at, "f": {root-relative
    path: [size, stored size]}}}`` of one directory (``view``: as saves see it, whose sizes the manifest records; ``storage``: as
    stored, larger when encrypted; ``read``: the authenticated view manifests are read
    through). A manifest that does not validate counts as absent (the node's copy is replaced
    from another node's); a file whose size cannot be read is listed at size -1 (replaced)."""
    out: dict[str, Any] = {}
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        files: dict[str, list[int]] = {}
        for path in walk_files(storage, step_dir(step)):
            if path.endswith((".tmp", MANIFEST_NAME)):
                continue
            try:
                stored = storage.size(path)
            except CheckpointError:
                files[path] = [-1, -1]
                continue
            try:
                files[path] = [view.size(path), stored]
            except CheckpointError:  # e.g. an encrypted file cut short: its header does not parse
                files[path] = [-1, stored]
        digest, created = None, None
        if storage.exists(manifest_path(step)):
            try:
                created = load_manifest(read, step).created_at or None
                digest = manifest_digest(storage, step)
            except CheckpointError:
                pass
        out[str(step)] = {"m": digest is not None, "d": digest, "c": created, "f": files}
    return out


def required_files(read: Storage, step: int) -> dict[str, tuple[int, bool]]:
    """Root-relative path -> (size, exact) of every file ``step`` needs (``read``: the
    authenticated view of this node's directory): its own at the size written (exact), and
    the files of earlier steps an incremental save points at, at least to the end of the
    last byte it uses."""
    m = load_manifest(read, step)
    out: dict[str, tuple[int, bool]] = {}
    for rel, end in m.chunk_file_ends(pages=False).items():
        path = resolve_file(step, rel)
        if path is not None:
            out[path] = (int(end), False)
    for rel, info in m.files.items():
        path = resolve_file(step, rel)
        if path is not None:
            out[path] = (int(info["size_bytes"]), True)
    return out


def _entry(listing: dict[str, Any], path: str) -> list[int] | None:
    step = parse_step_dir(path.split("/", 1)[0])
    return None if step is None else listing.get(str(step), {}).get("f", {}).get(path)


def _size(listing: dict[str, Any], path: str) -> int | None:
    got = _entry(listing, path)
    return None if got is None else int(got[0])


def covers(size: int | None, need: tuple[int, bool]) -> bool:
    """Whether a copy of ``size`` bytes is the file ``need`` asks for."""
    return size is not None and (size == need[0] if need[1] else size >= need[0])


def _same_step(gathered: list[dict[str, Any]], asked: int | None, me: int) -> None:
    """Refuse, on every rank, a restore whose ranks asked for different steps."""
    got = sorted({-1 if g["asked"] is None else int(g["asked"]) for g in gathered})
    if len(got) > 1:
        what = "the newest step" if asked is None else f"step={asked}"
        raise ValueError(
            f"restore with a local tier: rank {me} asked for {what}, but the ranks asked for "
            f"{', '.join('the newest' if v < 0 else str(v) for v in got)}; nothing was read. Pass the same step= "
            f"on every rank (or step=None everywhere)"
        )


def choose(group: TierGroup, nodes: NodeMap, local: Any, persistent: Storage, asked: int | None) -> Choice:
    """Collective: the tier and step to restore (``local``: this node's directory, a
    ``tiering.Opened``; ``persistent``: the persistent root, without encryption)."""
    me = group.rank
    mine: dict[str, Any] = {"asked": asked, "node": None, "persisted": [], "error": None}
    try:
        if nodes.is_leader(me):
            mine["node"] = list_node(local.storage, local.raw, local.read)
        if me == 0:
            mine["persisted"] = manifest_steps(persistent)
    except Exception as e:  # every rank hears it (below): none skips a collective
        mine["error"] = f"{type(e).__name__}: {e}"
    gathered = group.all_gather_json(mine, f"rank {me}: the tiers' listings")
    _same_step(gathered, asked, me)
    errors = {r: g["error"] for r, g in enumerate(gathered) if g["error"] is not None}
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        raise CheckpointError(f"rank {me}: listing the tiers failed on {len(errors)} rank(s): {detail}")
    listings = [gathered[nodes.leader(k)]["node"] for k in range(len(nodes.nodes))]
    persisted = sorted(gathered[0]["persisted"])
    here = listings[nodes.node_of(me)]
    candidates = sorted({int(s) for lst in listings for s, v in lst.items() if v["m"]}, reverse=True)
    conflicts = []
    for s in list(candidates):  # one commit gives one manifest: two differ after a rollback (an old disk back)
        if len({lst[str(s)]["d"] for lst in listings if lst.get(str(s), {}).get("m")}) > 1:
            candidates.remove(s)
            conflicts.append(s)
    if asked is not None:
        candidates = [s for s in candidates if s == asked]
    flags, needs = [], {}
    for s in candidates:
        flag = 0
        if here.get(str(s), {}).get("m"):
            try:
                need = needs[s] = required_files(local.read, s)
            except CheckpointError:
                flag = 1  # (it validated while listed: changed since)
            else:
                if any(not any(covers(_size(lst, p), n) for lst in listings) for p, n in need.items()):
                    flag = 1
        flags.append(flag)
    agreed = group.all_reduce_max(flags, f"rank {me}: which steps are whole in the local tiers") if flags else []
    whole = [s for s, f in zip(candidates, agreed) if f == 0]
    choice = Choice(None, None, whole, persisted, listings, needs, conflicts)
    newest = max([*whole[:1], *persisted[-1:]], default=-1)
    for s in conflicts:  # an older one is kept as it is: the newer step restored does not need it
        if s == asked or (asked is None and s > newest):
            raise CheckpointError(_conflict(me, s, listings, nodes))
        log.warning("rank %d: the nodes hold different manifests of step %d, older than the step restored; kept", me, s)
    target = asked if asked is not None else newest
    if target in persisted and any(lst.get(str(target), {}).get("m") for lst in listings):
        _same_across_tiers(group, nodes, persistent, listings, target)
    if asked is not None:
        if whole:
            choice.tier, choice.step = LOCAL, asked
        elif asked in persisted:
            choice.tier, choice.step = PERSISTENT, asked
        return choice
    if whole and (not persisted or whole[0] >= persisted[-1]):
        choice.tier, choice.step = LOCAL, whole[0]
    elif persisted:
        choice.tier = PERSISTENT
    return choice


def _same_across_tiers(
    group: TierGroup, nodes: NodeMap, persistent: Storage, listings: list[dict[str, Any]], step: int
) -> None:
    """Collective: raise on every rank when a node holds a manifest of ``step`` other than
    the persistent root's (rank 0 reads that one; when it cannot, nothing is judged)."""
    me, mine = group.rank, b""
    if me == 0:
        digest = manifest_digest(persistent, step)
        created = None
        try:
            created = load_manifest(persistent, step).created_at or None
        except CheckpointError:
            pass  # (an encrypted manifest reads only through the key: its digest says enough)
        mine = json.dumps({"d": digest, "c": created}).encode() if digest is not None else b""
    got = group.broadcast_bytes(mine, 0, f"rank {me}: the persistent root's manifest of step {step}")
    if not got:
        log.warning("rank %d: the persistent root's manifest of step %d could not be read to compare", me, step)
        return
    remote = json.loads(got)
    if all(lst[str(step)]["d"] == remote["d"] for lst in listings if lst.get(str(step), {}).get("m")):
        return
    held = "; ".join(
        f"node {k} (ranks {nodes.nodes[k][0]}-{nodes.nodes[k][-1]}): manifest {lst[str(step)]['d'][:8]}, "
        f"created {lst[str(step)].get('c') or '?'}"
        for k, lst in enumerate(listings)
        if lst.get(str(step), {}).get("m") and lst[str(step)]["d"] != remote["d"]
    )
    raise CheckpointError(
        f"rank {me}: step {step} is held by the local tier ({held}) and by the persistent root {persistent.url} "
        f"(manifest {remote['d'][:8]}, created {remote['c'] or '?'}) with different manifests: two writers saved "
        f"this step (two jobs on one root, or a node directory from another history), and neither copy is trusted "
        f"as this run's, so nothing is restored. Find which writer this run is (`shardkeeper ls ROOT --local DIR` "
        f"on each node shows the copies): if the persistent copy is this run's, remove the local copies (`rm -r "
        f"DIR/{step_dir(step)}` on those nodes) and restart; if the local copy is, stop the other writer, then "
        f"restore an older step (restore(step=...)) and go on under another root"
    )


def _conflict(me: int, step: int, listings: list[dict[str, Any]], nodes: NodeMap) -> str:
    held = "; ".join(
        f"node {k} (ranks {nodes.nodes[k][0]}-{nodes.nodes[k][-1]}): manifest {lst[str(step)]['d'][:8]}, "
        f"created {lst[str(step)].get('c') or '?'}"
        for k, lst in enumerate(listings)
        if lst.get(str(step), {}).get("m")
    )
    return (
        f"rank {me}: the nodes hold different manifests of step {step} ({held}): a node's local directory "
        f"holds a copy from another history (an old disk back after a rollback?), and neither is trusted over "
        f"the other, so nothing is restored. Remove the stale copy on its node (`rm -r DIR/{step_dir(step)}`; "
        f"`shardkeeper ls ROOT --local DIR` there shows its steps), then restart"
    )


def make_whole(group: TierGroup, nodes: NodeMap, local: Any, choice: Choice, step: int) -> tuple[int, int]:
    """Collective: every node's copy of ``step`` made whole from the others (the manifest by
    broadcast, files by ``move_files``). Returns (files, bytes) this rank received. Every
    local failure is agreed on, so every rank raises together and none waits."""
    me, key = group.rank, str(step)
    raw = local.raw
    listings = choice.listings
    has_manifest = [bool(lst.get(key, {}).get("m")) for lst in listings]
    where = f"step {step}, rank {me}"
    if not all(has_manifest):
        _spread_manifest(group, nodes, local, has_manifest, step, where)
    need: dict[str, tuple[int, bool]] | None = choice.needs.get(step)
    if need is None or not all(has_manifest):  # (else every rank read it while choosing)
        need, error = {}, None
        try:
            need = required_files(local.read, step)
        except Exception as e:
            error = e
        group.agree_ok(error, f"{where}: reading the manifest")
    plan, stale = [], []
    for k, lst in enumerate(listings):
        missing = [p for p in sorted(need) if not covers(_size(lst, p), need[p])]
        for i, path in enumerate(missing):
            holders = [h for h, other in enumerate(listings) if covers(_size(other, path), need[path])]
            h = holders[i % len(holders)]
            stored = int((_entry(listings[h], path) or [0, 0])[1])
            src_node, dst_node = nodes.nodes[h], nodes.nodes[k]
            plan.append(Move(path, stored, src_node[i % len(src_node)], dst_node[i % len(dst_node)]))
            if k == nodes.node_of(me) and nodes.is_leader(me) and _size(lst, path) is not None:
                stale.append((path, _size(lst, path), h))
    if plan:
        error = None
        try:
            _remove_stale(local, stale, need, step, me)
        except Exception as e:
            error = e
        group.agree_ok(error, f"{where}: removing copies of the wrong size")
    got: list[str] = []
    error = None
    try:
        got = move_files(group, raw, plan, f"{where}: making this node's copy whole")
    except Exception as e:  # this rank's own failure, or a sender's: agreed below
        error = e
    if plan:
        group.agree_ok(error, f"{where}: making every node's copy whole")
    return len(got), sum(m.size for m in plan if m.dst == me)


def _spread_manifest(
    group: TierGroup, nodes: NodeMap, local: Any, has_manifest: list[bool], step: int, where: str
) -> None:
    """Collective: the manifest of ``step``, from the first node that holds one, recorded on
    every node without it (``has_manifest``, per node); a failure anywhere raises everywhere."""
    raw, me = local.raw, group.rank
    holder = nodes.leader(has_manifest.index(True))
    data, error = None, None
    if me == holder:
        try:
            data = raw.read_bytes(manifest_path(step))
        except Exception as e:
            error = e
    data = group.broadcast_bytes(data, holder, f"{where}: the manifest for nodes without it")
    if nodes.is_leader(me) and not has_manifest[nodes.node_of(me)] and error is None and data:
        try:
            if raw.exists(manifest_path(step)):
                local.storage.delete(manifest_path(step))  # a copy that does not validate
            raw.put_if_absent(manifest_path(step), data)
        except Exception as e:
            error = e
    group.agree_ok(error, f"{where}: recording the manifest on every node")


def _remove_stale(
    local: Any, stale: list[tuple[str, int | None, int]], need: dict[str, tuple[int, bool]], step: int, me: int
) -> None:
    """This node's copies of the wrong size that are replaced (``stale``: path, its size, the
    node the new copy comes from), removed through the view (its caches forget them), each said."""
    for path, size, h in stale:
        log.warning(
            "rank %d: step %d: this node's copy of %s in %s is %s (%s bytes expected); replacing it with "
            "node %d's copy",
            me,
            step,
            path,
            local.raw.url,
            "unreadable" if size is not None and size < 0 else f"{size} bytes",
            need[path][0],
            h,
        )
        remove_copy(local.storage, path)


__all__ = ["LOCAL", "PERSISTENT", "Choice", "choose", "list_node", "make_whole", "required_files"]
