"""The torch side of the core: canonical state, chunking, staging, writing, restoring.

Everything that imports torch lives here; the format, storage, commit and CLI do not.
"""

__all__: list[str] = []
