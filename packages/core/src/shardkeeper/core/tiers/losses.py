"""What a step lost beyond its parity (``erasure=(k, m)``): the groups that lost more shards
of some piece than their m parity shards rebuild, named with their lost nodes (index, ranks
and directory) and the remedy, for the restore that falls back past the step (``rebuild.py``).

A data node of a group is lost in a step when one of its files (its parity records list
them) is on no node at its size; when no record of the group survives, when no node holds a
file of it in its directory. A parity shard's piece is lost when no node holds it intact.
"""

from __future__ import annotations

from typing import Any

from shardkeeper.core.tiers.nodes import NodeMap
from shardkeeper.core.tiers.placement import Group, arrange, parity_name


def _group_losses(
    listings: list[dict[str, Any]], step: int, group: Group, m: int
) -> tuple[list[int], list[int], list[int]] | None:
    """(its data nodes, its lost data nodes, the nodes whose parity of it is missing or
    damaged) when ``group`` cannot be rebuilt in ``step``; None when it lost no data node or
    its parity covers the loss. The data nodes are those its records name: the numbering of
    the job that saved the step, which a job of another size does not share."""
    key = str(step)
    have = [lst["files"].get(key, {}) for lst in listings]
    recs = [(n, r) for n, lst in enumerate(listings) for r in lst["records"].get(key, []) if r["group"] == group.index]
    if recs:
        rec = next((r for _, r in recs if r["ok"]), recs[0][1])
        present = [any(all(h.get(p) == s for p, s in member) for h in have) for member in rec["members"]]
        data, m = [int(n) for n in rec["nodes"]], int(rec.get("m", m))
        lost = [data[i] for i, ok in enumerate(present) if not ok]
        pieces = max(1, -(-int(rec["length"]) // int(rec["piece_bytes"])))
    else:
        data = list(group.data)
        lost, pieces = [n for n in group.data if not have[n]], 1
    if not lost:
        return None
    held = {(r["shard"], p) for _, r in recs if r["ok"] for p in r["pieces"]}
    # past the last piece held, every piece is short and the holders repeat after len(outside)
    pieces = min(pieces, max((p for _, p in held), default=-1) + 1 + len(group.outside))
    k = len(data)
    short = [p for p in range(pieces) if k - len(lost) + sum((j, p) in held for j in range(m)) < k]
    if not short:
        return None
    return data, lost, sorted({group.holder(j, p, m) for p in short for j in range(m) if (j, p) not in held})


def _why(listings: list[dict[str, Any]], step: int, group: int, node: int) -> str | None:
    """Why ``node``'s parity of ``group`` in ``step`` cannot rebuild, when the node was not
    lost (its parity directory is a link, its file or record is damaged); None: lost."""
    lst = listings[node]
    damaged = [r for r in lst["records"].get(str(step), []) if r["group"] == group]
    why = [str(r["damage"]) for r in damaged if r.get("damage")] or [
        f"its record {lst.get('dir', '?')}/{parity_name(step, group, r['shard'])}.json holds fewer pieces than its "
        f"length ({r['length']} bytes) implies: the record is damaged (or forged)"
        for r in damaged
    ]
    return lst.get("link") or (why[0] if why else None)


def node_names(nodes: NodeMap, listings: list[dict[str, Any]], which: list[int]) -> str:
    """``which`` named for a message: each node's index, ranks and directory; a node of the
    job that saved a step beyond this job's nodes (the job shrank) as not in this job."""

    def one(n: int) -> str:
        if not 0 <= n < min(len(nodes.nodes), len(listings)):
            return f"node {n} (of the job that saved the step; this job has {len(nodes.nodes)} nodes)"
        ranks = nodes.nodes[n]
        shown = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {n} ({shown}, {listings[n].get('dir', '?')})"

    out = [one(n) for n in which]
    return out[0] if len(out) == 1 else ", ".join(out[:-1]) + " and " + out[-1]


def _parity(nodes: NodeMap, listings: list[dict[str, Any]], step: int, group: int, gone: list[int]) -> str:
    """The group's parity that is missing (on nodes lost) or damaged (each node, and why)."""
    why = {n: _why(listings, step, group, n) for n in gone}
    missing = [n for n in gone if why[n] is None]
    out = f", and its parity on {node_names(nodes, listings, missing)}" if missing else ""
    return out + "".join(
        f", and its parity on {node_names(nodes, listings, [n])} "
        f"{'unreadable' if why[n] == listings[n].get('link') else 'damaged'}: {why[n]}"
        for n in gone
        if why[n]
    )


def lost_beyond_parity(
    listings: list[dict[str, Any]], nodes: NodeMap, erasure: tuple[int, int], asked: int | None, chosen: int | None
) -> list[str]:
    """A note for the steps with a manifest on some node (``asked``: that one) newer than
    ``chosen`` (the step the rebuild took; None: none) that lost more nodes of a group than
    its parity rebuilds (with ``chosen`` None, down to the first step that lost no data
    node), one per loss: the steps, each such group and its lost nodes, and the remedy."""
    k, m = erasure
    groups = arrange(len(listings), k, m)
    steps = sorted({int(s) for lst in listings for s in lst["manifests"]}, reverse=True)
    losses: dict[str, list[int]] = {}  # what was lost -> the steps that lost it
    for step in [s for s in steps if s == asked] if asked is not None else steps:
        if chosen is not None and step <= chosen:
            break
        over = [(g, got) for g in groups if (got := _group_losses(listings, step, g, m)) is not None]
        if not over:
            if chosen is None:
                break
            continue
        parts = "; ".join(
            f"group {g.index} (node{'s' if len(data) > 1 else ''} {', '.join(map(str, data))}) lost "
            f"{node_names(nodes, listings, lost)}{_parity(nodes, listings, step, g.index, gone)}"
            for g, (data, lost, gone) in over
        )
        losses.setdefault(parts, []).append(step)
    notes = []
    for parts, lost_steps in losses.items():
        damaged = (
            " (a node whose parity is named damaged or unreadable was not lost: only that parity cannot be used, for "
            "the reason given)"
            if "damaged: " in parts or "unreadable: " in parts
            else ""
        )
        lost_steps.sort()
        shown = f"step {lost_steps[0]}" if len(lost_steps) == 1 else f"steps {', '.join(map(str, lost_steps))}"
        notes.append(
            f"{shown} lost more nodes than parity rebuilds ({parts}; erasure=({k}, {m}) rebuilds at most {m} lost "
            f"node(s) of a group): not restorable from the nodes, so the restore falls back to an older step whole "
            f"or rebuildable on the nodes left, else to the persistent root's newest step. To restore {shown}, stop "
            f"the job, put the lost nodes' directories back as they were (their disks), and restart{damaged}; to survive "
            f"more lost nodes at once, pass a larger m in erasure=(k, m), or upload more often (persist_every)"
        )
    return notes


__all__ = ["lost_beyond_parity", "node_names"]
