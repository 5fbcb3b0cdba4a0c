"""A committed step written by an importer, in one process (``dcp_import``, ``hf/importer.py``).

The importer hands over batches of full tensors; each batch becomes one shard file, written
and digested by the same code as a save (``save/write.py``), and object leaves are JSON values.
``commit`` checks every leaf's tiling, builds the manifest, validates it as a reader will and
writes it with put-if-absent; an import that fails removes the files it wrote. A step already
committed is refused before a byte is written (the put stays the fence against a race).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from shardkeeper.core.commit.committed import manifest_path, write_latest_hint
from shardkeeper.core.errors import CheckpointError, CommitConflictError, StateMismatchError
from shardkeeper.core.format.layout import DATA_DIR, new_attempt_id, shard_file, step_dir
from shardkeeper.core.format.leaves import LazyLeaves
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.tiling import check_tiling_boxes
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.save.write import _write_file, chunk_records
from shardkeeper.core.state.flatten import torch_dtype_name
from shardkeeper.core.storage.base import Storage

if TYPE_CHECKING:
    from typing_extensions import Buffer


class ImportedStep:
    """Step ``step`` of ``storage``, being written from ``source`` (named in errors). Use as a
    context manager: leaving it by an exception removes what was written."""

    def __init__(self, storage: Storage, step: int, *, source: str, digest: str, digest_block_bytes: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if storage.exists(manifest_path(step)):  # before a byte is written; the put stays the fence
            raise CommitConflictError(
                f"step {step} is already committed under {storage.url}; nothing was imported. Import under "
                f"another step (--step), delete that step first, or choose another root"
            )
        self.storage, self.step, self.source = storage, step, source
        self.digest, self.block = digest, digest_block_bytes
        self.dir = step_dir(step)
        self.attempt = new_attempt_id()
        self.leaves: dict[str, Any] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.written: list[str] = []
        self._pool = ThreadPoolExecutor(1)

    def __enter__(self) -> ImportedStep:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if exc is not None:
                self.abort()
        finally:
            self._pool.shutdown()

    def add_object(self, key: str, value: Any) -> None:
        self.leaves[key] = {"kind": "object", "value": value}

    def write(self, batch: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One shard file of ``batch``'s full tensors (contiguous CPU tensors of a stored dtype)."""
        items, spans = [], []
        for key, t in batch:
            nbytes = t.numel() * t.element_size()
            buf = memoryview(cast("Buffer", t.reshape(-1).view(torch.uint8).numpy())) if nbytes else memoryview(b"")
            shape = tuple(t.shape)
            items.append(WriteItem(key, torch_dtype_name(t.dtype), shape, (0,) * len(shape), shape, t, nbytes))
            spans.append((buf, 0, nbytes))
        rel = shard_file(0, self.attempt, len(self.written))
        self.written.append(rel)
        offsets, digests, size = self._pool.submit(
            _write_file, self.storage, self.dir, rel, items, spans, self.digest, self.block
        ).result()
        self.files[rel] = {"size_bytes": size, "rank": 0}
        for (key, rec), it in zip(chunk_records(rel, items, offsets, digests), items, strict=True):
            self.leaves[key] = {
                "kind": "tensor",
                "dtype": it.dtype,
                "shape": list(it.shape),
                "chunks": [rec] if it.nbytes else [],
            }

    def commit(self, metadata: Mapping[str, Any]) -> Manifest:
        """Write the manifest (``metadata`` after the framework's own); the committed manifest."""
        storage = self.storage
        if self.written:
            storage.sync_dir(f"{self.dir}/{DATA_DIR}")
            storage.sync_dir(self.dir)
        for key, leaf in self.leaves.items():
            if leaf["kind"] == "tensor":
                why = check_tiling_boxes(key, leaf["shape"], [(c["offsets"], c["shape"]) for c in leaf["chunks"]])
                if why is not None:
                    raise StateMismatchError(f"{self.source}: {key}: {why}")
        manifest = Manifest(
            step=self.step,
            world_size=1,
            leaves=LazyLeaves(dict(sorted(self.leaves.items()))),
            files=dict(sorted(self.files.items())),
            digest_algorithm=self.digest,
            digest_block_bytes=self.block,
            metadata={"framework": "torch", "torch_version": torch.__version__, "world_size": 1, **metadata},
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            attempt=self.attempt,
        )
        data = manifest.dumps()
        path = manifest_path(self.step)
        committed = Manifest.loads(data, where=storage.describe(path))  # validated as a reader will
        storage.put_if_absent(path, data)
        try:
            write_latest_hint(storage, self.step)
        except CheckpointError:
            pass  # a hint only
        return committed

    def abort(self) -> None:
        """Remove the files written (the manifest was not)."""
        for rel in self.written:
            try:
                self.storage.delete(f"{self.dir}/{rel}")
            except CheckpointError:
                pass


def batches(sizes: Sequence[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names in order, grouped into batches of at most ``limit`` bytes (a larger one alone)."""
    out: list[list[str]] = [[]]
    total = 0
    for name, n in sizes:
        if out[-1] and total + n > limit:
            out.append([])
            total = 0
        out[-1].append(name)
        total += n
    return [b for b in out if b]


__all__ = ["ImportedStep", "batches"]
