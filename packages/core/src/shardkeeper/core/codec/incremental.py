"""Incremental checkpoints: find the chunk of the previous checkpoint a new chunk equals.

A chunk is reused when the newest committed checkpoint of the same root has a chunk of the
same key, box (offsets and shape) and dtype whose *content id* equals the new chunk's. The
content id is the digest (with the manifest's algorithm) of the comma-joined digests of the
chunk's raw bytes in ``digest_block_bytes`` blocks: for a raw chunk it follows from the
record's own ``digests``; an encoded chunk records it as ``content``. The new record then
points at the file that holds the bytes (``../step-N/data/...``), never at another reference.
On an encrypted root a chunk is reused only when that file is sealed under the key the
manager now wraps with (``sealed``): after a key rotation a save is full once, so no step
keeps needing a retired key through references.

Torch-free: the writer calls it with digests it computed from the staged bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

from shardkeeper.core.commit.committed import lists_manifest, load_manifest, step_dirs
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import BlockDigests, ChunkRecord
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


def content_id(raw_block_digests: Sequence[str], algorithm: str) -> str:
    """The content id of a chunk from the digests of its raw (unencoded) bytes."""
    return digest_function(algorithm)(",".join(raw_block_digests).encode())


def reference_path(base_step: int, rel: str) -> str:
    """``rel`` (relative to step ``base_step``'s directory) as seen from a sibling step:
    a file of that step becomes ``../step-N/data/...``; a reference stays as it is, so a
    reference always names the file that holds the bytes."""
    return rel if rel.startswith("../") else f"../{step_dir(base_step)}/{rel}"


def newest_step_below(storage: Storage, before: int) -> int | None:
    """The highest step directory below ``before`` that has a manifest (one listing each)."""
    for step, name in sorted(step_dirs(storage).items(), reverse=True):
        if step < before and lists_manifest(storage, name):
            return step
    return None


def newest_manifest(storage: Storage, before: int | None = None) -> Manifest | None:
    """The newest committed manifest (below step ``before`` if given), or None."""
    for step in sorted(step_dirs(storage), reverse=True):
        if before is not None and step >= before:
            continue
        try:
            return load_manifest(storage, step)
        except CheckpointError:
            continue  # not committed (in flight, damaged, newer format): look further back
    return None


class ReuseIndex:
    """Looks up reusable chunks of a base manifest by (key, offsets, shape, dtype, content)."""

    def __init__(
        self, base: Manifest, algorithm: str, block_bytes: int, sealed: Callable[[str], bool] | None = None
    ) -> None:
        """``sealed(path)``: whether the file at root-relative ``path`` may be referenced (an
        encrypted root: it is sealed under the key new files are); None: any file may."""
        # Digests of another algorithm or block size never compare equal: nothing to reuse.
        self.usable = base.digest_algorithm == algorithm and base.digest_block_bytes == block_bytes
        self.base = base
        self.algorithm = algorithm
        self._sealed = sealed
        self._held: dict[str, bool] = {}  # file (relative to the base step) -> sealed(path), asked once
        self._by_key: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkRecord]] = {}

    def find(
        self, key: str, dtype: str, offsets: Sequence[int], shape: Sequence[int], content: str
    ) -> dict[str, Any] | None:
        """The chunk record (JSON form) that stores this content by reference, or None."""
        if not self.usable:
            return None
        leaves = self.base.leaves
        if isinstance(leaves, TableLeaves) and leaves.described is not None and key in leaves.described.pos:
            # A described leaf: only the chunks of this box, from the index files that hold
            # them (not every rank's, as the leaf's whole chunk list would read).
            head = leaves.head(key)
            try:  # (a leaf of another number of dimensions meets none: overlapping finds nothing)
                found = leaves.overlapping(key, offsets, shape) if head.dtype == dtype else []
            except CheckpointError:  # a damaged base: nothing of it is reused, the save goes on
                found = []
            boxes = {(c.offsets, c.shape): c for c in found}
        else:
            cached = self._by_key.get(key)
            if cached is None:
                leaf = leaves.get(key)
                cached = {}
                if leaf is not None and leaf.kind != "object" and leaf.dtype == dtype:
                    cached = {(c.offsets, c.shape): c for c in leaf.chunks}
                self._by_key[key] = cached
            boxes = cached
        prev = boxes.get((tuple(offsets), tuple(shape)))
        if prev is None:
            return None
        prev_content = prev.content or (content_id(prev.digests, self.algorithm) if prev.encoding == "raw" else "")
        if prev_content != content or not self._may_reference(prev.file):
            return None
        rec = prev.to_json()
        rec["file"] = reference_path(self.base.step, prev.file)
        if prev.encoding != "raw" and "content" not in rec:
            rec["content"] = content
        rec["digests"] = BlockDigests.of(prev.digests).text
        return cast("dict[str, Any] | None", rec)

    def _may_reference(self, rel: str) -> bool:
        """Whether the base's file ``rel`` may hold a new step's bytes (asked once per file)."""
        if self._sealed is None:
            return True
        held = self._held.get(rel)
        if held is None:
            path = resolve_file(self.base.step, rel)
            held = self._held[rel] = path is not None and self._sealed(path)
        return held


__all__ = ["ReuseIndex", "content_id", "newest_manifest", "newest_step_below", "reference_path"]
