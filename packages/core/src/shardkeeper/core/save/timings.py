"""The timings a commit records in ``metadata.timings``: what the advisor (tools/advisor.py) and
``shardkeeper advise`` read back to recommend an interval."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def save_timings(reports: Sequence[Mapping[str, Any]], commit_s: float) -> dict[str, Any]:
    """The ``metadata.timings`` of a commit from the ranks' reports (the coordinator's first)."""
    ts = [r.get("timings") or {} for r in reports]
    own = ts[0] if ts else {}
    return {
        "stall_s": round(max((float(t.get("stall_s", 0.0)) for t in ts), default=0.0), 6),
        "write_s": round(max((float(t.get("write_s", 0.0)) for t in ts), default=0.0), 6),
        "commit_s": round(commit_s, 6),
        "save_s": round(float(own.get("write_s", 0.0)) + commit_s, 6),
        "sync": bool(own.get("sync", False)),
    }


__all__ = ["save_timings"]
