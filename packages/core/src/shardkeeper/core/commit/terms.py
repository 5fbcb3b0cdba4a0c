"""The terms of one save that every rank must share: the step and the options the manifest
records for all ranks alike.

The ranks of a save meet under the same store keys because every rank numbers its saves alike
(``seq``), not because they passed the same step: a rank that calls ``save(3)`` while the others
call ``save(2)`` reports under the same keys. So every report and every outcome carries the
save's terms; the coordinator (and a group leader, for its group) compares each report's with
its own and fails the save on any difference, naming each rank's step or value, and a rank
accepts an outcome only for its own terms. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import SaveTermsMismatch

#: The report and outcome member that carries the terms (absent: a sender that sets none).
MEMBER = "terms"


@dataclass(frozen=True)
class SaveTerms:
    """``step`` and ``options`` (JSON values by name) of one save on one rank."""

    step: int
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "options": dict(self.options)}

    @staticmethod
    def of(doc: object) -> SaveTerms | None:
        """The terms a message carries, or None when it carries none or not in this shape."""
        if not isinstance(doc, dict) or type(doc.get("step")) is not int or not isinstance(doc.get("options"), dict):
            return None
        return SaveTerms(doc["step"], doc["options"])


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0-2, 5``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    one = len(runs) == 1 and runs[0][0] == runs[0][1]
    return f"{'rank' if one else 'ranks'} {', '.join(parts[:16])}{', ...' if len(parts) > 16 else ''}"


def mismatch(own: SaveTerms, own_rank: int, others: Mapping[int, SaveTerms | None]) -> SaveTermsMismatch | None:
    """The error when some rank of ``others`` (rank -> the terms its report carried) saves on
    other terms than ``own`` (those of ``own_rank``), naming every rank's step or value."""
    everyone = {own_rank: own, **{r: t for r, t in others.items() if t is not None}}
    differing = [r for r, t in everyone.items() if t != own]
    if not differing:
        return None
    lines = []
    steps: dict[int, list[int]] = {}
    for r, t in everyone.items():
        steps.setdefault(t.step, []).append(r)
    if len(steps) > 1:
        each = "; ".join(f"step {s} on {ranks_text(rs)}" for s, rs in sorted(steps.items()))
        lines.append(f"different steps ({each})")
    names = sorted({n for t in everyone.values() for n in t.options})
    for name in names:
        values: dict[str, list[int]] = {}
        for r, t in everyone.items():
            values.setdefault(repr(t.options.get(name)), []).append(r)
        if len(values) > 1:
            each = "; ".join(f"{v} on {ranks_text(rs)}" for v, rs in sorted(values.items()))
            lines.append(f"different {name} ({each})")
    return SaveTermsMismatch(
        f"the ranks of one save passed {', and '.join(lines)}; every rank must call save() with the same step "
        f"and the same manager options, in the same order. Nothing was committed",
        step=own.step,
    )


def agreed_options(settings: Any, encryption: str | None, *, tiered: bool) -> dict[str, Any]:
    """The manager's options that every rank of a save must share: the manifest records them
    once for all ranks (its digests, codecs, data prefixes, encryption binding), or the
    protocol depends on them (a local tier). ``encryption``: the binding of an encrypted root."""
    s = settings
    return {
        "digest": s.digest,
        "digest_block_bytes": s.digest_block_bytes,
        "compression": s.compression or "none",
        "describe_layouts": s.describe_layouts,
        "data_prefixes": s.data_prefixes,
        "encryption": encryption,
        "local_tier": tiered,
    }


__all__ = ["MEMBER", "SaveTerms", "SaveTermsMismatch", "agreed_options", "mismatch", "ranks_text"]
