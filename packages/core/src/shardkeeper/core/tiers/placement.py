"""Where the erasure-coded node tier's parity lies, what a node holds of it, and which lost
files can be rebuilt: torch-free, for the tiers (``parity.py``, ``rebuild.py``) and for
``shardkeeper ls --local``.

Nodes ``0..N-1`` form groups of ``k`` consecutive nodes; when N is not a multiple of k the last
group has the N mod k nodes left (its parity costs m times its own size, spread as below).
A group's parity is cut into pieces (``erasure.PIECE_BYTES``); piece ``r`` of shard ``j`` of a
group is held by the ``(r * m + j) mod (N - size)``-th node after the group: never a node of
the group (which needs N >= k + m), the m shards of one piece on m different nodes, and the
pieces spread evenly over the nodes outside the group, so that each node holds about m/k of
a node's data in parity when N is a multiple of k and larger than k. A holder keeps the
pieces it holds of shard ``j`` of a step's group ``g``, in order, as ``PARITY_DIR/<step
dir>/g<g>-p<j>`` beside a JSON record (``+ ".json"``): the code, the group's nodes, each
node's files with their stored sizes, the data streams' lengths, the parity's length, which
pieces the file holds and each one's xxh3-128 digest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from shardkeeper.core.commit.committed import load_manifest, manifest_path
from shardkeeper.core.commit.files import resolve_file, walk_files
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.storage.base import Storage

#: Where a node keeps the parity it holds: beside the step directories, never in them (a step
#: directory holds what its manifest lists; uploads, gc and verification see only that).
PARITY_DIR = ".parity"


@dataclass(frozen=True)
class Group:
    """Group ``index``: its data nodes and the other nodes, in order after it (node indices)."""

    index: int
    data: tuple[int, ...]
    outside: tuple[int, ...]

    def holder(self, shard: int, piece: int, m: int) -> int:
        """The node that holds ``piece`` of parity ``shard``."""
        return self.outside[(piece * m + shard) % len(self.outside)]


def arrange(count: int, k: int, m: int) -> list[Group]:
    """The groups of ``count`` nodes under ``erasure=(k, m)``; a ``ValueError`` saying what
    to do when there are fewer than k + m nodes."""
    from shardkeeper.core.tiers.erasure import check_code  # (numpy: not for the CLI, which reads parity only)

    k, m = check_code(k, m)
    if count < k + m:
        if count - m >= 1:
            hint = f"pass erasure=({count - m}, {m}), a smaller m, or replicas=1 (a full copy), or run on more nodes"
        elif count > 1:
            hint = f"pass erasure=({count - 1}, 1) or replicas=1, or run on more nodes"
        else:
            hint = "drop erasure= (one node: only the persistent root outlives its loss), or run on more nodes"
        raise ValueError(
            f"erasure=({k}, {m}) needs at least k + m = {k + m} nodes (local directories), but the job's ranks "
            f"share {count}: a group's parity must lie on m nodes outside it. {hint[0].upper()}{hint[1:]}"
        )
    out = []
    for g, start in enumerate(range(0, count, k)):
        data = tuple(range(start, min(start + k, count)))
        out.append(Group(g, data, tuple((start + len(data) + j) % count for j in range(count - len(data)))))
    return out


def parity_name(step: int, group: int, shard: int) -> str:
    """The parity file of ``shard`` of ``group`` for ``step`` (its record: ``+ ".json"``)."""
    return f"{PARITY_DIR}/{step_dir(step)}/g{group}-p{shard}"


def records(storage: Storage) -> dict[int, list[dict[str, Any]]]:
    """This node's parity records by step (one whose JSON does not parse is skipped: its
    shard then counts as lost)."""
    out: dict[int, list[dict[str, Any]]] = {}
    if not storage.exists(PARITY_DIR):
        return out
    for name in storage.list_dir(PARITY_DIR):
        base = f"{PARITY_DIR}/{name.rstrip('/')}"
        for f in storage.list_dir(base):
            if not f.endswith(".json"):
                continue
            try:
                rec = json.loads(storage.read_bytes(f"{base}/{f}"))
                out.setdefault(int(rec["step"]), []).append(rec)
            except (CheckpointError, ValueError, KeyError, TypeError):
                continue
    return out


def prune(storage: Storage, keep: set[int]) -> None:
    """Remove the parity of every step not in ``keep`` (the steps this node still holds), and
    of every step without a manifest older than the newest committed one of ``keep``: a
    failed or killed save's leftovers (a save in flight is newer), never a committed step's."""
    newest = max((s for s in keep if storage.exists(manifest_path(s))), default=None)
    for name in storage.list_dir(PARITY_DIR):
        step = parse_step_dir(name)
        if step is None:
            continue
        left = newest is not None and step < newest and not storage.exists(manifest_path(step))
        if step not in keep or left:
            storage.delete_dir(f"{PARITY_DIR}/{step_dir(step)}")


def _points_at(read: Storage, step: int) -> list[int]:
    """The earlier steps whose files ``step`` points at (an incremental save); [] when its
    manifest cannot be read here (encrypted without the key)."""
    try:
        ends = load_manifest(read, step).chunk_file_ends(pages=False)
    except CheckpointError:
        return []
    paths = (resolve_file(step, rel) for rel in ends)
    return sorted({s for p in paths if p for s in [parse_step_dir(p.split("/", 1)[0])] if s is not None} - {step})


def pointed_at(raw: Storage, read: Storage) -> set[int]:
    """The earlier steps that the steps committed on this node point at (incremental saves).
    Retention keeps them whole: a group's parity rebuilds a lost node's files only with every
    other node's files of the step (and the parity itself stays while the step does)."""
    steps = {s for s in map(parse_step_dir, raw.list_dir("")) if s is not None}
    return {r for s in steps if raw.exists(manifest_path(s)) for r in _points_at(read, s)}


def _damage(raw: Storage, step: int, rec: dict[str, Any]) -> str | None:
    """Why a parity record, or its file, cannot rebuild anything (named for the warnings), or
    None: its lengths must be its members' sizes, its parity's length the longest rounded up
    to 8 bytes, its file as long as the pieces it records. Raises ``KeyError``, ``TypeError``
    or ``ValueError`` for a record that is no parity record at all."""
    rel = parity_name(step, int(rec["group"]), int(rec["shard"]))
    lengths, total, piece = [int(n) for n in rec["lengths"]], int(rec["length"]), int(rec["piece_bytes"])
    sizes = [sum(int(n) for _, n in member) for member in rec["members"]]
    count = -(-total // piece) if piece > 0 else -1
    want = sum(min(piece, total - int(p) * piece) for p in rec["pieces"] if 0 <= int(p) < count)
    if (
        sizes != lengths
        or len(lengths) != int(rec["k"])
        or total != -(-max(lengths, default=0) // 8) * 8
        or len(rec["pieces"]) != len(rec["digests"])
        or any(not 0 <= int(p) < count for p in rec["pieces"])
        or int(rec["size"]) != want
    ):
        return f"its record {raw.url}/{rel}.json is damaged (its lengths, pieces and size disagree)"
    if not raw.exists(rel):
        return f"{raw.url}/{rel} is missing"
    size = raw.size(rel)
    return None if size == want else f"{raw.url}/{rel} holds {size} bytes, its record says {want}"


def _link(raw: Storage) -> str | None:
    """Why the node's parity directory is not read (a symbolic link), or None."""
    is_link = getattr(raw, "is_link", None)
    if is_link is None or not is_link(PARITY_DIR):
        return None
    try:
        target = repr(os.readlink(os.path.join(raw.url, PARITY_DIR)))
    except OSError:
        target = "?"
    return (
        f"{raw.url}/{PARITY_DIR} is a symbolic link to {target}: shardkeeper never lists, writes or deletes through "
        f"a link (a save there fails), so the parity it points at is not read. Remedy: move what it points at into "
        f"{raw.url} in its place, or remove the link"
    )


def listing(raw: Storage, read: Storage) -> dict[str, Any]:
    """A node's parity records (each with ``ok`` and, when not, why: ``damage``), why its
    parity directory is not read (``link``), the files of its steps (stored sizes), their
    manifests and the earlier steps each points at (``raw``: its directory, unencrypted;
    ``read``: the view manifests are read through), as ``plan`` reads them."""
    recs = records(raw)
    files: dict[str, dict[str, int]] = {}
    manifests, refs = [], {}
    for step, got in list(recs.items()):
        kept = []
        for rec in got:  # a parity file cut short, or a record that disagrees with itself, is no shard
            try:
                rec["damage"] = _damage(raw, step, rec)
            except (KeyError, TypeError, ValueError):
                continue  # no parity record (as one whose JSON does not parse)
            rec["ok"] = rec["damage"] is None
            kept.append(rec)
        recs[step] = kept
    for step in sorted({s for s in map(parse_step_dir, raw.list_dir("")) if s is not None}):
        here = {}
        for p in walk_files(raw, step_dir(step)):
            try:
                here[p] = raw.size(p)
            except CheckpointError:
                continue
        files[str(step)] = here
        if raw.exists(manifest_path(step)):
            manifests.append(step)
            refs[str(step)] = _points_at(read, step)
    return {
        "records": {str(s): r for s, r in recs.items()},
        "link": _link(raw),
        "files": files,
        "manifests": manifests,
        "refs": refs,
    }


@dataclass(frozen=True)
class Job:
    """One group of ``step`` rebuilt on node ``target``, for the restore of step ``of``
    (``step`` itself, or a later one that points at its files), whose manifest checks the
    rebuilt files: ``lost`` its data shards rebuilt, ``record`` one of its records,
    ``rounds[r]`` for piece ``r`` the k shards read (shard -> [node, offset in the file or
    stream]), ``digests`` each parity piece's xxh3-128."""

    of: int
    step: int
    target: int
    lost: list[int]
    record: dict[str, Any]
    rounds: list[dict[int, tuple[int, int]]]
    digests: dict[tuple[int, int], str]  # (parity shard, piece) -> digest


def _job(step: int, shards: list[tuple[int, dict[str, Any]]], have: list[dict[str, int]], nodes: int) -> Job | None:
    """The rebuild of one group (``shards``: its records and their nodes, damaged ones too),
    or None when no data node was lost; raises ``LookupError`` when some piece lacks k
    intact shards."""
    ok = [(n, r) for n, r in shards if r["ok"]]
    rec = (ok or shards)[0][1]
    k, piece = rec["k"], rec["piece_bytes"]
    holder = [
        next((n for n, h in enumerate(have) if all(h.get(p) == s for p, s in member)), None)
        for member in rec["members"]
    ]
    lost = [i for i, h in enumerate(holder) if h is None]
    if not lost:
        return None
    if not ok:
        raise LookupError(0)  # every record of the group damaged: no parity left
    at: dict[tuple[int, int], tuple[int, int]] = {}
    digests: dict[tuple[int, int], str] = {}
    for n, r in ok:
        for index, (p, digest) in enumerate(zip(r["pieces"], r["digests"])):
            at[(r["shard"], p)] = (n, index * piece)
            digests[(r["shard"], p)] = digest
    rounds = []
    for p in range(-(-rec["length"] // piece)):
        avail = {i: (h, p * piece) for i, h in enumerate(holder) if h is not None}
        avail.update({k + j: at[(j, p)] for j in range(rec["m"]) if (j, p) in at})
        if len(avail) < k:
            raise LookupError(p)
        rounds.append({i: avail[i] for i in sorted(avail)[:k]})
    return Job(step, step, rec["nodes"][lost[0]] % nodes, lost, rec, rounds, digests)


def _step_jobs(listings: list[dict[str, Any]], step: int, nodes: int) -> list[Job]:
    """The groups of ``step`` that lost data nodes (``LookupError``: some cannot be rebuilt)."""
    key = str(step)
    have = [lst["files"].get(key, {}) for lst in listings]
    groups: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for n, lst in enumerate(listings):
        for rec in lst["records"].get(key, []):
            groups.setdefault(rec["group"], []).append((n, rec))
    return [j for j in (_job(step, g, have, nodes) for g in groups.values()) if j is not None]


def plan(listings: list[dict[str, Any]], asked: int | None, nodes: int, skip: set[int] | None = None) -> list[Job]:
    """The groups to rebuild (every rank alike): those that lost data nodes, of the newest step
    with a manifest somewhere (or ``asked``) and of the earlier steps it points at, when each
    of their pieces keeps k shards; else the same for the next older step. [] when the newest
    is whole on the nodes (or nothing can be rebuilt; a step judged without parity counts as
    whole: the restore then judges it). Steps in ``skip`` (a rebuild of them failed) count
    as not rebuildable."""
    steps = sorted({s for lst in listings for s in lst["manifests"]} - (skip or set()), reverse=True)
    for step in [s for s in steps if s == asked] if asked is not None else steps:
        refs = sorted({r for lst in listings for r in lst.get("refs", {}).get(str(step), [])})
        try:
            jobs = [replace(j, of=step) for s in [step, *refs] for j in _step_jobs(listings, s, nodes)]
        except LookupError:
            continue  # more lost than parity left: an older step, or the restore falls back
        return jobs
    return []


__all__ = ["PARITY_DIR", "Group", "Job", "arrange", "listing", "parity_name", "plan", "pointed_at", "prune", "records"]
