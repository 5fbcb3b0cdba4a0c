"""The manifest's optional ``logical`` member (docs/format.md, "Logical digests") and the sums
ranks report for it.

The member is ``{"algorithm": "sk-logical-1", "digests": "<d0>,<d1>,..."}``: one digest (16
lowercase hex digits, format/logical.py ``finalize``) per tensor and bytes leaf, in the order
of their keys sorted by code point, ``""`` where the writer recorded none. A reader that does
not know the member, or its algorithm, ignores it (an optional member, not a required feature).

On the wire, a rank's report carries, per key it wrote, its sum (lowercase hex, ``""`` for
0), in the order of its chunk report's ``keys`` (``chunks.logical``), and, with described
leaves, of every described key, sorted (``described.logical``; a group leader adds its
ranks' together). The coordinator adds every report's sums per key (``combine_reports``).

Torch- and numpy-free.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from shardkeeper.core.format.grid import Rule
from shardkeeper.core.format.leaves import RawLeaves
from shardkeeper.core.format.logical import ALGORITHM, MASK, add_sums, decode_sums, encode_sums, finalize
from shardkeeper.core.format.replica_copies import REPLICAS, disagreements
from shardkeeper.core.format.table import TableLeaves

MEMBER = "logical"
#: The member's mark of a step committed although replicas disagreed (``logical_check="warn"``):
#: a non-empty string of at most ``MARK_CHARS`` characters naming the tensors and ranks.
MARK = "replicas_disagree"
MARK_CHARS = 65536
_DIGEST = re.compile(r"[0-9a-f]{16}")


def tensor_keys(leaves: Mapping[str, Any]) -> list[str]:
    """The keys of a manifest's tensor and bytes leaves, sorted: the member's order."""
    if isinstance(leaves, TableLeaves):
        more = leaves.described.keys if leaves.described is not None else []
        return sorted([*leaves.leaf_table.keys, *more])
    if isinstance(leaves, RawLeaves):
        return sorted(k for k, v in leaves.raw.items() if isinstance(v, dict) and v.get("kind") in ("tensor", "bytes"))
    return sorted(k for k, v in leaves.items() if v.kind in ("tensor", "bytes"))


class _Null:
    """A ``"logical": null`` as read: kept apart from an absent member, so that it is refused."""

    def __repr__(self) -> str:
        return "null"


NULL = _Null()


def member_of(doc: Mapping[str, Any]) -> Any:
    """A manifest document's ``logical`` member as ``Manifest.logical`` holds it: None when
    absent, ``NULL`` for ``null`` (which ``member_problem`` refuses), else as read."""
    if MEMBER not in doc:
        return None
    return NULL if doc[MEMBER] is None else doc[MEMBER]


def member_problem(member: object, leaves: Mapping[str, Any]) -> str | None:
    """Why a manifest's ``logical`` member is damaged, or None: not an object of two strings
    (``null`` included: an absent member is left out), a ``replicas_disagree`` mark that is
    not a non-empty string of at most ``MARK_CHARS`` characters, or (of a known algorithm)
    not one digest or ``""`` per tensor and bytes leaf, the first wrong entry named."""
    if member is None or member is NULL:
        return "its logical member is null (a manifest without digests leaves the member out)"
    if not isinstance(member, dict) or not isinstance(member.get("algorithm"), str):
        return "its logical member is not an object with a string algorithm"
    digests = member.get("digests")
    if not isinstance(digests, str):
        return "its logical member has no string of digests"
    if MARK in member:
        mark = member[MARK]
        if not isinstance(mark, str) or not mark or len(mark) > MARK_CHARS:
            what = f"a string of {len(mark)} characters" if isinstance(mark, str) else f"of type {type(mark).__name__}"
            return f"its logical member's {MARK} mark is {what}, not a string of 1 to {MARK_CHARS} characters"
    if member["algorithm"] != ALGORITHM:
        return None  # another definition's: ignored, not judged
    keys = tensor_keys(leaves)
    fields = digests.split(",") if keys or digests else []
    if len(fields) != len(keys):
        return (
            f"its logical member holds {len(fields)} digest(s) for {len(keys)} tensor and bytes leaves "
            f"(one digest or an empty one per leaf, in key order)"
        )
    for i, (key, d) in enumerate(zip(keys, fields)):
        if d and not _DIGEST.fullmatch(d):
            return (
                f"its logical member's digest {i} (of leaf {key!r}) is {d[:40]!r}, not 16 lowercase hex digits or empty"
            )
    return None


def digests_of(member: object, leaves: Mapping[str, Any]) -> dict[str, str | None] | None:
    """Each tensor and bytes leaf's logical digest (None: not recorded) from a checked
    manifest's member; None without the member or for an algorithm this reader does not know."""
    if not isinstance(member, dict) or member.get("algorithm") != ALGORITHM:
        return None
    keys = tensor_keys(leaves)
    fields = member["digests"].split(",") if keys else []
    return {k: d or None for k, d in zip(keys, fields)}


def combine_reports(
    reports: Sequence[Mapping[str, Any]],
    declared: Mapping[str, Sequence[Any]],
    described: Mapping[str, Rule] | Iterable[str],
    counted: Mapping[str, Collection[int] | None] | None = None,
) -> dict[str, Any] | None:
    """The manifest's member from every rank's report (their chunks' and described sums) and
    the leaves every rank declared (key -> [kind, dtype, shape]); ``described``: the described
    leaves, as key -> rule (a copy of one that disagrees is named with the ranks its rule
    makes write it) or as keys (named with "its written copy"); ``counted``: leaves whose
    duplicate chunks the coordinator dropped (two ranks wrote a box), each with the indices
    of the reports whose sums together cover it once (``commit/merge.py``), or None where no
    such reports exist (no digest). None when a report has no sums (a writer that does not
    compute them). ValueError names a rank whose sums do not match its keys."""
    counted = counted or {}
    dkeys = sorted(described)
    sums: dict[str, int] = {}
    for n, r in enumerate(reports):
        chunks = r["chunks"]
        if not isinstance(chunks, dict) or "logical" not in chunks or "keys" not in chunks:
            return None
        parts = [(chunks["keys"], chunks["logical"])]
        if dkeys:
            text = (r.get("described") or {}).get("logical")
            if text is None:
                return None
            parts.append((dkeys, text))
        for keys, text in parts:
            try:
                values = decode_sums(text, len(keys))
            except ValueError as e:
                raise ValueError(f"rank {r['rank']}'s report: {e}") from None
            for k, s in zip(keys, values):
                if k not in counted or n in (counted[k] or ()):
                    sums[k] = (sums.get(k, 0) + s) & MASK
    skip = set(counted)
    digests = [
        "" if k in skip and counted[k] is None else finalize(str(declared[k][1]), declared[k][2], sums.get(k, 0))
        for k in sorted(declared)
    ]
    member: dict[str, Any] = {"algorithm": ALGORITHM, "digests": ",".join(digests)}
    rules = described if isinstance(described, Mapping) else None
    disagree = disagreements(reports, sums, declared, skip, rules)
    if disagree:
        member[MARK] = _mark(disagree)
    return member


def _mark(disagree: Sequence[str]) -> str:
    """The disagreements as the mark says them: joined, those beyond ``MARK_CHARS`` counted."""
    out: list[str] = []
    used = 0
    for i, d in enumerate(disagree):
        more = f"; and {len(disagree) - i} more tensor(s)"
        if used + len(d) + 2 + len(more) > MARK_CHARS:
            return "; ".join(out) + more
        out.append(d)
        used += len(d) + 2
    return "; ".join(out)


def disagreements_in(mark: str) -> int:
    """How many leaves a ``replicas_disagree`` mark names: its entries (each begins
    ``tensor `` or ``bytes leaf ``), plus the ``N`` of a trailing ``; and N more tensor(s)``."""
    more = _MORE.search(mark)
    shown = mark[: more.start()] if more else mark
    return len(_ENTRY.findall(shown)) + (int(more.group(1)) if more else 0)


def marked_kinds(mark: str) -> str:
    """What a ``replicas_disagree`` mark's entries are, as a message says them: ``tensors``,
    ``bytes leaves`` or ``tensors and bytes leaves`` (those it only counts taken as tensors)."""
    found = {m.group(1) for m in _ENTRY.finditer(mark)}
    if "bytes leaf" not in found:
        return "tensors"
    return "tensors and bytes leaves" if "tensor" in found or _MORE.search(mark) else "bytes leaves"


_MORE = re.compile(r"; and (\d+) more tensor\(s\)$")
_ENTRY = re.compile(r"(?:^|; )(tensor|bytes leaf) ")


__all__ = [
    "MARK",
    "MARK_CHARS",
    "MEMBER",
    "NULL",
    "REPLICAS",
    "add_sums",
    "combine_reports",
    "decode_sums",
    "digests_of",
    "disagreements_in",
    "encode_sums",
    "marked_kinds",
    "member_of",
    "member_problem",
    "tensor_keys",
]
