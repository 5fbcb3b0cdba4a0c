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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardkeeper.core.format.leaves import RawLeaves
from shardkeeper.core.format.logical import ALGORITHM, MASK, finalize
from shardkeeper.core.format.table import TableLeaves

MEMBER = "logical"
#: A rank's chunk report member with the sums of the replicated copies it holds and does not
#: write (save/replicas.py): ``{"keys": [...], "copies": [...], "sums": "<hex>,..."}``.
REPLICAS = "replicas"
_DIGESTS = re.compile(r"(?:[0-9a-f]{16})?(?:,(?:[0-9a-f]{16})?)*")
_SUMS = re.compile(r"(?:[0-9a-f]{1,16})?(?:,(?:[0-9a-f]{1,16})?)*")


def encode_sums(sums: Iterable[int]) -> str:
    """Sums as the wire has them: hex without leading zeros, ``""`` for 0, comma-separated."""
    return ",".join(format(s, "x") if s else "" for s in sums)


def decode_sums(text: object, count: int) -> list[int]:
    """``encode_sums``' text of ``count`` sums, or ValueError saying what is wrong."""
    if not isinstance(text, str) or not _SUMS.fullmatch(text):
        raise ValueError(f"its logical sums are not comma-separated hex numbers: {str(text)[:60]!r}")
    fields = text.split(",") if count else []
    if count == 0 and text or len(fields) != count:
        raise ValueError(f"it sends {len(fields) if text or count else 0} logical sums for {count} keys")
    return [int(f, 16) if f else 0 for f in fields]


def add_sums(texts: Sequence[object], count: int) -> str:
    """Several ranks' sums of the same ``count`` keys (described ones), added per key."""
    total = [0] * count
    for text in texts:
        total = [(a + b) & MASK for a, b in zip(total, decode_sums(text, count))]
    return encode_sums(total)


def tensor_keys(leaves: Mapping[str, Any]) -> list[str]:
    """The keys of a manifest's tensor and bytes leaves, sorted: the member's order."""
    if isinstance(leaves, TableLeaves):
        more = leaves.described.keys if leaves.described is not None else []
        return sorted([*leaves.leaf_table.keys, *more])
    if isinstance(leaves, RawLeaves):
        return sorted(k for k, v in leaves.raw.items() if isinstance(v, dict) and v.get("kind") in ("tensor", "bytes"))
    return sorted(k for k, v in leaves.items() if v.kind in ("tensor", "bytes"))


def member_problem(member: object, leaves: Mapping[str, Any]) -> str | None:
    """Why a manifest's ``logical`` member is damaged, or None: not an object of two strings,
    or (of a known algorithm) not one digest or ``""`` per tensor and bytes leaf."""
    if not isinstance(member, dict) or not isinstance(member.get("algorithm"), str):
        return "its logical member is not an object with a string algorithm"
    digests = member.get("digests")
    if not isinstance(digests, str):
        return "its logical member has no string of digests"
    if member["algorithm"] != ALGORITHM:
        return None  # another definition's: ignored, not judged
    n = len(tensor_keys(leaves))
    if not _DIGESTS.fullmatch(digests) or (digests.count(",") + 1 if n else len(digests)) != n:
        return f"its logical member does not hold one digest or an empty one per tensor and bytes leaf ({n})"
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
    described: Iterable[str],
    uncounted: Iterable[str] = (),
) -> dict[str, Any] | None:
    """The manifest's member from every rank's report (their chunks' and described sums) and
    the leaves every rank declared (key -> [kind, dtype, shape]); ``uncounted``: leaves whose
    duplicate chunks the coordinator dropped (two ranks counted them: no digest). None when a
    report has no sums (a writer that does not compute them). ValueError names a rank whose
    sums do not match its keys."""
    dkeys = sorted(described)
    sums: dict[str, int] = {}
    for r in reports:
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
                sums[k] = (sums.get(k, 0) + s) & MASK
    skip = set(uncounted)
    digests = [
        "" if k in skip else finalize(str(declared[k][1]), declared[k][2], sums.get(k, 0)) for k in sorted(declared)
    ]
    member: dict[str, Any] = {"algorithm": ALGORITHM, "digests": ",".join(digests)}
    disagree = _disagreements(reports, sums, declared, skip)
    if disagree:
        member["replicas_disagree"] = "; ".join(disagree)
    return member


def _disagreements(
    reports: Sequence[Mapping[str, Any]], sums: Mapping[str, int], declared: Mapping[str, Any], skip: set[str]
) -> list[str]:
    """The copies whose sums (their ranks' ``replicas`` members added) differ from the written
    copy's, each naming the tensor, the copy's ranks and the ranks that wrote it."""
    copies: dict[tuple[str, int], list[Any]] = {}  # (key, copy) -> [sum, ranks]
    for r in reports:
        rep = r["chunks"].get(REPLICAS)
        if rep is None:
            continue
        keys, nums = (
            rep.get("keys") if isinstance(rep, dict) else None,
            rep.get("copies") if isinstance(rep, dict) else None,
        )
        if not isinstance(keys, list) or not isinstance(nums, list) or len(keys) != len(nums):
            raise ValueError(f"rank {r['rank']}'s report: its replicas member is not keys and copies of one length")
        try:
            values = decode_sums(rep.get("sums"), len(keys))
        except ValueError as e:
            raise ValueError(f"rank {r['rank']}'s report, its replicas: {e}") from None
        for k, c, v in zip(keys, nums, values):
            entry = copies.setdefault((str(k), int(c)), [0, []])
            entry[0] = (entry[0] + v) & MASK
            entry[1].append(r["rank"])
    out = []
    for (k, _), (total, ranks) in sorted(copies.items()):
        if k in skip or k not in declared or total == sums.get(k, 0):
            continue
        writers = [r["rank"] for r in reports if k in r["chunks"].get("keys", ())]
        wrote = f"rank(s) {writers}" if writers else "its written copy"
        out.append(f"tensor {k!r}: the copy on rank(s) {sorted(ranks)} differs from the one {wrote} wrote")
    return out


__all__ = [
    "MEMBER",
    "REPLICAS",
    "add_sums",
    "combine_reports",
    "decode_sums",
    "digests_of",
    "encode_sums",
    "member_problem",
    "tensor_keys",
]
