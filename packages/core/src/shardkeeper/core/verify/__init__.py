"""Checking committed steps end to end: files, ranges, digests, headers (torch-free)."""

__all__: list[str] = []
