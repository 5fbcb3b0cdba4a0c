"""The installed shardkeeper-core release, as every manifest records it (``shardkeeper_version``)."""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def shardkeeper_version() -> str:
    """``importlib.metadata``'s version of ``shardkeeper-core``; ``unknown`` for a source tree on
    ``sys.path`` that was never installed."""
    try:
        return importlib.metadata.version("shardkeeper-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__all__ = ["shardkeeper_version"]
