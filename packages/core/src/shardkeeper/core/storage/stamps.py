"""Modification times as fsspec backends report them (datetimes, numbers, ISO strings), in seconds since the epoch."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast


def stamp_of(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec ``info`` or listing entry, if it has one."""
    for key in ("LastModified", "mtime", "updated", "last_modified", "modified", "created"):
        if info.get(key) is not None:
            try:
                return timestamp(info[key])
            except (TypeError, ValueError):
                continue
    return None


def timestamp(value: Any) -> float:
    """``value`` (a datetime, naive ones in UTC; a number; an ISO 8601 string) in seconds since the epoch."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return cast("float", value.timestamp())
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return timestamp(datetime.fromisoformat(value.replace("Z", "+00:00")))
    raise TypeError(f"not a timestamp: {value!r}")


__all__ = ["stamp_of", "timestamp"]
