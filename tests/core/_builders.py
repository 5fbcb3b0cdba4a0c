"""Build committed (or uncommitted) checkpoints without torch, the way the real writer does.

Shard files: ``format.safetensors.build_header`` + the chunks' row-major bytes back to back,
one file per rank, written through ``storage.open_writer``. Digests: ``format.digest.
block_digests``. Commit: ``Manifest(...).dumps()`` + ``storage.put_if_absent``, written last,
then the LATEST hint.

Tensor data is given as the global tensor's row-major bytes. By default a tensor is split
along dim 0 over the ranks (rank r owns an even share of rows); ``placement`` puts a whole
tensor on one rank. ``reuse`` stores a key as a reference to an earlier step's chunks
(``../step-.../data/...``), as an incremental save does.
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from shardkeeper.core.commit.committed import load_manifest, manifest_path, write_latest_hint
from shardkeeper.core.format.digest import block_digests
from shardkeeper.core.format.layout import new_attempt_id, shard_file, step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord, itemsize
from shardkeeper.core.format.safetensors import build_header, chunk_name
from shardkeeper.core.storage.base import Storage

TensorData = tuple[str, Sequence[int], bytes]  # (dtype, global shape, row-major bytes)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``shardkeeper ARGV...`` in this process: its exit code, stdout and stderr."""
    from shardkeeper.core.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def make_bytes(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic pseudo-random bytes."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def tensor(dtype: str, shape: Sequence[int], seed: int = 0) -> TensorData:
    n = math.prod(shape) * itemsize(dtype)
    return dtype, tuple(shape), make_bytes(n, seed)


def _row_split(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [a, b) row ranges, as even as possible (some may be empty)."""
    base, extra = divmod(rows, parts)
    out, a = [], 0
    for r in range(parts):
        b = a + base + (1 if r < extra else 0)
        out.append((a, b))
        a = b
    return out


def write_step(
    storage: Storage,
    step: int,
    tensors: Mapping[str, TensorData] | None = None,
    *,
    objects: Mapping[str, Any] | None = None,
    blobs: Mapping[str, bytes] | None = None,
    world_size: int = 1,
    placement: Mapping[str, int] | None = None,
    reuse: Mapping[str, int] | None = None,
    algorithm: str = "xxh3_128",
    block_bytes: int = 64,
    metadata: Mapping[str, Any] | None = None,
    per_rank_prefixes: Sequence[str] = (),
    attempt: str | None = None,
    commit: bool = True,
    latest: bool = True,
) -> Manifest:
    """Write step ``step`` under ``storage``; returns its manifest (committed unless
    ``commit=False``, in which case only the shard files are written)."""
    tensors = dict(tensors or {})
    placement = dict(placement or {})
    attempt = attempt or new_attempt_id()
    base = step_dir(step)

    # (rank) -> list of (key, dtype, global shape, offsets, box shape, bytes)
    per_rank: dict[int, list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bytes]]]
    per_rank = {r: [] for r in range(world_size)}
    leaves_meta: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # key -> (kind, dtype, shape)

    items: list[tuple[str, str, str, tuple[int, ...], bytes]] = [
        (k, "tensor", d, tuple(s), b) for k, (d, s, b) in tensors.items()
    ]
    items += [(k, "bytes", "uint8", (len(b),), b) for k, b in (blobs or {}).items()]
    for key, kind, dtype, shape, data in items:
        assert len(data) == math.prod(shape) * itemsize(dtype), f"{key}: wrong byte count"
        leaves_meta[key] = (kind, dtype, shape)
        if key in placement or not shape or shape[0] < world_size:
            per_rank[placement.get(key, 0)].append((key, dtype, shape, (0,) * len(shape), shape, data))
            continue
        row = math.prod(shape[1:]) * itemsize(dtype)
        for r, (a, b) in enumerate(_row_split(shape[0], world_size)):
            if a == b:
                continue
            offsets = (a,) + (0,) * (len(shape) - 1)
            box = (b - a,) + tuple(shape[1:])
            per_rank[r].append((key, dtype, shape, offsets, box, data[a * row : b * row]))

    chunks: dict[str, list[ChunkRecord]] = {k: [] for k in leaves_meta}
    files: dict[str, dict[str, Any]] = {}
    for rank, entries in per_rank.items():
        if not entries:
            continue
        rel = shard_file(rank, attempt, 0)
        header, offsets_in_file = build_header(
            [(chunk_name(k, o, s, g), d, s, len(b)) for k, d, g, o, s, b in entries],
            metadata={"format": "pt", "writer": "shardkeeper"},
        )
        w = storage.open_writer(f"{base}/{rel}")
        w.write(header)
        for (key, _d, _g, o, s, b), at in zip(entries, offsets_in_file, strict=True):
            w.write(b)
            chunks[key].append(
                ChunkRecord(
                    file=rel,
                    offset=at,
                    length=len(b),
                    offsets=o,
                    shape=s,
                    digests=tuple(block_digests(memoryview(b), algorithm, block_bytes)),
                )
            )
        w.close()
        files[rel] = {"size_bytes": len(header) + sum(len(e[5]) for e in entries), "rank": rank}
    storage.sync_dir(f"{base}/data")

    leaves: dict[str, LeafRecord] = {}
    for key, (kind, dtype, shape) in leaves_meta.items():
        leaves[key] = LeafRecord(kind=kind, dtype=dtype, shape=shape, chunks=tuple(chunks[key]))
    for key, prev in (reuse or {}).items():
        old = load_manifest(storage, prev).leaves[key]
        moved = []
        for c in old.chunks:
            target = posixpath.normpath(f"{step_dir(prev)}/{c.file}")
            moved.append(
                ChunkRecord(
                    file=f"../{target}",
                    offset=c.offset,
                    length=c.length,
                    offsets=c.offsets,
                    shape=c.shape,
                    digests=c.digests,
                    encoding=c.encoding,
                )
            )
        leaves[key] = LeafRecord(kind=old.kind, dtype=old.dtype, shape=old.shape, chunks=tuple(moved))
    for key, value in (objects or {}).items():
        leaves[key] = LeafRecord(kind="object", value=value)

    m = Manifest(
        step=step,
        world_size=world_size,
        leaves=leaves,
        files=files,
        digest_algorithm=algorithm,
        digest_block_bytes=block_bytes,
        per_rank_prefixes=tuple(per_rank_prefixes),
        metadata=dict(metadata or {"framework": "test", "world_size": world_size}),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        attempt=attempt,
    )
    if commit:
        storage.put_if_absent(manifest_path(step), m.dumps())
        if latest:
            write_latest_hint(storage, step)
    return m


def set_mtime(root: str | os.PathLike[str], rel: str, mtime: float) -> None:
    """Set the mtime of ``rel`` under a local root, and of everything below it."""
    top = os.path.join(os.fspath(root), rel)
    for dirpath, _dirs, names in os.walk(top):
        for n in names:
            os.utime(os.path.join(dirpath, n), (mtime, mtime))
        os.utime(dirpath, (mtime, mtime))
    if os.path.isfile(top):
        os.utime(top, (mtime, mtime))


def age_everything(root: str | os.PathLike[str], seconds: float | None = None) -> None:
    """Make every file under a local root ``seconds`` old (default: an hour beyond gc's default age)."""
    if seconds is None:
        from shardkeeper.core.lifecycle.gc import DEFAULT_GC_MIN_AGE_S

        seconds = DEFAULT_GC_MIN_AGE_S + 3600.0
    t = time.time() - seconds
    for name in os.listdir(root):
        set_mtime(root, name, t)
