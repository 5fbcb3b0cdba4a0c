"""The ``replicas`` member of a chunk report: the sums of the replicated copies a rank holds
and does not write (save/replicas.py), folded by a group leader, and compared by the
coordinator with the written copy's sums (docs/protocol.md, "Commit": replica agreement).

A rank's member lists one entry per key: ``keys``, ``copies`` (its copy's number) and
``sums`` (hex, comma-separated). A group leader *folds* its group's members into one
(``fold``): the partial sums of a copy are added (its pieces may lie on several ranks of the
group), and copies of a key whose sums are equal become one entry, ``copies`` and ``ranks``
then lists of ``[first, last]`` runs. So under DDP the group's ranks, which otherwise differ
only by their copy's number, report alike and fold into one report again, and the
coordinator reads one entry per key and group instead of one per key and rank.

The coordinator (``disagreements``) adds every entry's sum over the copies it names, per key,
with one sweep over the runs' ends (a copy whose pieces lay in several groups gets each
group's part), and names each copy whose total is not the written copy's sum, and the ranks
that wrote that copy: those whose chunk reports list the key, or, for a described leaf (whose
chunks no report lists), the ranks its rule gives its boxes (format/grid.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardkeeper.core.format.cells import overlapping_cells
from shardkeeper.core.format.grid import Rule
from shardkeeper.core.format.logical import MASK, decode_sums, encode_sums

REPLICAS = "replicas"

#: One entry: a key's copies (``[first, last]`` runs), the ranks holding them (runs), and
#: the sum each of those copies has (its part held in this report's ranks).
Entry = tuple[list[list[int]], list[list[int]], int]


def entries(member: object, rank: int) -> dict[str, list[Entry]]:
    """A report's member as entries per key (a rank's or a leader's folded one); ValueError
    naming what is wrong with it."""
    keys, copies = (member.get("keys"), member.get("copies")) if isinstance(member, dict) else (None, None)
    if not isinstance(keys, list) or not isinstance(copies, list) or len(keys) != len(copies):
        raise ValueError("its replicas member is not keys and copies of one length")
    assert isinstance(member, dict)
    values = decode_sums(member.get("sums"), len(keys))
    folded = member.get("ranks")
    if folded is not None and (not isinstance(folded, list) or len(folded) != len(keys)):
        raise ValueError("its folded replicas member has no ranks per entry")
    out: dict[str, list[Entry]] = {}
    for i, (k, c, v) in enumerate(zip(keys, copies, values)):
        if folded is None:
            out.setdefault(str(k), []).append(([[int(c), int(c)]], [[rank, rank]], v))
        else:
            out.setdefault(str(k), []).append((_checked_runs(c), _checked_runs(folded[i]), v))
    return out


def _checked_runs(runs: object) -> list[list[int]]:
    if not isinstance(runs, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and r[0] <= r[1] for r in runs
    ):
        raise ValueError(f"its folded replicas member has a run list that is not [first, last] pairs: {runs!r:.60}")
    return runs


def fold(members: Sequence[tuple[int, object]]) -> dict[str, Any] | None:
    """A group leader's one member for its ranks' ``(rank, member)`` (None for a rank without
    one); None when no rank has one. ValueError names a rank whose member is malformed."""
    acc: dict[tuple[str, int], list[Any]] = {}  # (key, copy) -> [sum, ranks]
    for rank, member in members:
        if member is None:
            continue
        try:
            got = entries(member, rank)
        except ValueError as e:
            raise ValueError(f"rank {rank}'s report: {e}") from None
        for key, es in got.items():
            for copies, ranks, v in es:
                for first, last in copies:
                    for c in range(first, last + 1):
                        slot = acc.setdefault((key, c), [0, set()])
                        slot[0] = (slot[0] + v) & MASK
                        slot[1].update(r for a, b in ranks for r in range(a, b + 1))
    if not acc:
        return None
    alike: dict[tuple[str, int], list[Any]] = {}  # (key, sum) -> [copies, ranks]
    for (key, c), (v, ranks) in sorted(acc.items()):
        slot = alike.setdefault((key, v), [[], set()])
        slot[0].append(c)
        slot[1].update(ranks)
    order = sorted(alike)
    return {
        "keys": [k for k, _ in order],
        "copies": [runs(alike[o][0]) for o in order],
        "ranks": [runs(alike[o][1]) for o in order],
        "sums": encode_sums(v for _, v in order),
    }


def runs(values: Any) -> list[list[int]]:
    """Integers as sorted ``[first, last]`` runs."""
    out: list[list[int]] = []
    for x in sorted(set(values)):
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def disagreements(
    reports: Sequence[Mapping[str, Any]],
    sums: Mapping[str, int],
    declared: Mapping[str, Any],
    skip: set[str],
    rules: Mapping[str, Rule] | None = None,
) -> list[str]:
    """The copies whose sums (every report's entries added) differ from the written copy's
    (``sums``), each naming the tensor (or bytes leaf, as such), the copies' ranks and the ranks that wrote it (of a
    described leaf, of ``rules``: key -> its rule, those the rule gives its boxes)."""
    rules = rules or {}
    memo: dict[tuple[Any, ...], list[int]] = {}
    per_key: dict[str, list[Entry]] = {}
    for r in reports:
        member = r["chunks"].get(REPLICAS)
        if member is None:
            continue
        try:
            got = entries(member, r["rank"])
        except ValueError as e:
            raise ValueError(f"rank {r['rank']}'s report: {e}") from None
        for key, es in got.items():
            per_key.setdefault(key, []).extend(es)
    out = []
    for key, es in sorted(per_key.items()):
        if key in skip or key not in declared:
            continue
        for first, last in _differing(es, sums.get(key, 0)):
            rule = rules.get(key)
            if rule is None:
                writers = [r["rank"] for r in reports if key in r["chunks"].get("keys", ())]
            else:
                writers = _rule_writers(rule, tuple(declared[key][2]), memo)
            what = "bytes leaf" if declared[key][0] == "bytes" else "tensor"
            out.append(f"{what} {key!r}: the {_copies(es, first, last)} differs from the one {_wrote(writers)} wrote")
    return out


def _rule_writers(rule: Rule, shape: tuple[int, ...], memo: dict[tuple[Any, ...], list[int]]) -> list[int]:
    """The ranks that write a described leaf of ``shape``: those its rule gives its boxes
    (derived once per layout and shape: the leaves of a model share a few; a save shares
    one ``Mesh`` object per mesh)."""
    memo_key = (id(rule.mesh), rule.placements, rule.replica, rule.order, shape)
    got = memo.get(memo_key)
    if got is None:
        cells = overlapping_cells(shape, rule.mesh, rule.placements, rule.replica, (0,) * len(shape), shape, rule.order)
        got = memo[memo_key] = sorted({rank for rank, _, _ in cells})
    return got


def _differing(es: list[Entry], want: int) -> list[tuple[int, int]]:
    """The runs of copies whose entries' sums, added, are not ``want``: one sweep over the
    ends of every entry's runs (a sum enters at a run's first copy, leaves after its last)."""
    delta: dict[int, list[int]] = {}  # copy -> [sum change, coverage change]
    for copies, _, v in es:
        for first, last in copies:
            d = delta.setdefault(first, [0, 0])
            d[0], d[1] = d[0] + v, d[1] + 1
            d = delta.setdefault(last + 1, [0, 0])
            d[0], d[1] = d[0] - v, d[1] - 1
    out: list[tuple[int, int]] = []
    total = cover = 0
    points = sorted(delta)
    for here, after in zip(points, points[1:]):
        total, cover = total + delta[here][0], cover + delta[here][1]
        if cover and total & MASK != want:
            out.append((here, after - 1))
    return out


def _copies(es: list[Entry], first: int, last: int) -> str:
    """The copies ``first`` to ``last`` and their ranks, as a message says them: exactly where
    every entry naming them names just those copies, else the ranks of those entries ("among":
    an entry a leader folded over several copies does not say which rank holds which)."""
    meeting = [e for e in es if _meets(e[0], first, last)]
    held = _listed(sorted({x for _, ranks, _ in meeting for a, b in ranks for x in range(a, b + 1)}))
    exact = all(copies == [[first, last]] for copies, _, _ in meeting)
    if exact:
        return f"copy on rank(s) {held}" if first == last else f"copies {first} to {last} on rank(s) {held}"
    what = f"copy {first}" if first == last else f"copies {first} to {last}"
    return f"{what}, held among rank(s) {held},"


def _wrote(writers: list[int]) -> str:
    return f"rank(s) {_listed(writers)}" if writers else "its written copy"


def _meets(copies: list[list[int]], first: int, last: int) -> bool:
    return any(a <= last and first <= b for a, b in copies)


def _listed(ranks: list[int]) -> str:
    """Ranks as a list, the first 16 of a longer one named and the rest counted."""
    return str(ranks) if len(ranks) <= 16 else f"{str(ranks[:16])[:-1]}, ... ({len(ranks)} ranks)]"


__all__ = ["REPLICAS", "disagreements", "entries", "fold", "runs"]
