"""Save, per rank: plan what this rank writes, stage it to host memory, write shard files.

Only ``plan`` and ``stage`` run on the caller's thread; ``write_shards`` runs in the
background on the staged copies, so the caller may mutate its tensors as soon as ``save()``
returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import DATA_DIR, shard_file
from shardkeeper.core.format.manifest import DTYPES, ChunkRecord
from shardkeeper.core.format.safetensors import build_header, chunk_name
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tensor import _torch_compat as tc
from shardkeeper.core.tensor.chunks import balance_plain, layout_of, plain_layout, replica_writer
from shardkeeper.core.tensor.state import FlatState, as_torch, torch_dtype_name

if TYPE_CHECKING:
    from typing_extensions import Buffer

_ALIGN = 64


@dataclass
class WriteItem:
    """One chunk this rank writes: a box of a leaf, its source view and, once staged, its copy."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    src: torch.Tensor
    nbytes: int
    staged: torch.Tensor | None = None  # uint8, contiguous, in the staging buffer


@dataclass
class SavePlan:
    items: list[WriteItem] = field(default_factory=list)
    #: every tensor/bytes leaf this rank holds: key -> [kind, dtype, global shape]
    declared: dict[str, list[Any]] = field(default_factory=dict)
    #: object leaves this rank reports (replicated ones from the coordinator only)
    objects: dict[str, Any] = field(default_factory=dict)
    per_rank_prefixes: list[str] = field(default_factory=list)
    #: how this rank's tensors are distributed, for the manifest's metadata (not for restore)
    layouts: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def _dtype_name(key: str, dtype: torch.dtype) -> str:
    name = torch_dtype_name(dtype)
    if name not in DTYPES:
        raise StateMismatchError(
            f"state key {key!r} has dtype {name}, which the format does not store; supported: "
            f"{', '.join(DTYPES)}. Convert it (e.g. torch.view_as_real for complex) first"
        )
    return name


def describe_layout(t: torch.Tensor) -> str:
    """``DTensor(mesh=(2, 2), placements=(Shard(0), Shard(1)))``, ``ShardedTensor``, ``Tensor``."""
    if tc.is_dtensor(t):
        mesh = tuple(t.device_mesh.shape)
        names = t.device_mesh.mesh_dim_names
        placements = ", ".join(str(p) for p in t.placements)
        return f"DTensor(mesh={mesh}{', names=' + str(tuple(names)) if names else ''}, placements=({placements}))"
    if tc.is_sharded_tensor(t):
        return "ShardedTensor"
    return "Tensor"


def plan_save(flat: FlatState, rank: int, world_size: int) -> SavePlan:
    """Decide which chunks this rank writes. Deterministic: needs no communication."""
    plan = SavePlan(per_rank_prefixes=list(flat.per_rank_prefixes))
    layouts = {}
    plain_sizes: dict[str, int] = {}
    for key, leaf in flat.leaves.items():
        if leaf.kind == "object":
            if leaf.per_rank is not None or rank == 0:
                plan.objects[key] = leaf.value
            continue
        if leaf.kind == "bytes":
            t = torch.frombuffer(bytearray(leaf.value), dtype=torch.uint8) if leaf.value else torch.empty(0, dtype=torch.uint8)
        else:
            t = as_torch(leaf.value)
            if tc.is_dtensor(t) and any(tc.is_partial(p) for p in t.placements):
                raise StateMismatchError(
                    f"state key {key!r} is a DTensor with a Partial placement (a pending "
                    f"reduction); call .redistribute() to Replicate/Shard before saving"
                )
        layout = plain_layout(t, 1, 0) if leaf.per_rank is not None else layout_of(t, world_size, rank)
        dtype = _dtype_name(key, layout.dtype)
        plan.declared[key] = [leaf.kind, dtype, list(layout.global_shape)]
        plan.layouts.add(describe_layout(t))
        layouts[key] = layout
        if layout.plain and leaf.per_rank is None:
            plain_sizes[key] = math.prod(layout.global_shape) * DTYPES[dtype][1]
    writers = balance_plain(plain_sizes, world_size)
    for key, layout in layouts.items():
        if key in writers:
            if writers[key] != rank:
                continue
        elif layout.replicas > 1 and replica_writer(key, layout.replicas) != layout.replica_index:
            continue
        dtype = plan.declared[key][1]
        size = DTYPES[dtype][1]
        for p in layout.pieces:
            n = p.numel
            if n == 0:
                continue
            plan.items.append(
                WriteItem(key, dtype, layout.global_shape, p.offsets, p.shape, p.local, n * size)
            )
    return plan


class Stager:
    """Copies write items into one reusable host buffer (pinned when the sources are on CUDA).

    The buffer is allocated once and reused while the state's size does not grow, so steady
    state saves allocate nothing. Staging is the only part of a save that blocks training.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.last_stage_s = 0.0

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, items: Sequence[WriteItem]) -> None:
        t0 = time.perf_counter()
        offsets = []
        pos = 0
        any_cuda = False
        for it in items:
            offsets.append(pos)
            pos += -(-it.nbytes // _ALIGN) * _ALIGN
            any_cuda = any_cuda or it.src.is_cuda
        buf = self._buffer
        pinned = any_cuda and torch.cuda.is_available()
        if buf is None or buf.numel() < pos or (pinned and not buf.is_pinned()):
            self._buffer = None  # release before allocating the larger one
            buf = torch.empty(pos, dtype=torch.uint8, pin_memory=pinned)
            self._buffer = buf
        for it, off in zip(items, offsets):
            raw = buf[off : off + it.nbytes]
            dst = raw.view(it.src.dtype).view(it.shape)
            src = it.src
            if tc.is_dtensor(src):  # defensive: pieces are local views already
                src = src.to_local()
            dst.copy_(src, non_blocking=src.is_cuda)
            it.staged = raw
        if any_cuda:
            torch.cuda.synchronize()
        self.last_stage_s = time.perf_counter() - t0


def _split_files(items: Sequence[WriteItem], max_files: int, min_file_bytes: int) -> list[list[WriteItem]]:
    total = sum(i.nbytes for i in items)
    n = max(1, min(max_files, total // max(min_file_bytes, 1)))
    if n == 1:
        return [sorted(items, key=_file_order)]
    bins: list[list[WriteItem]] = [[] for _ in range(n)]
    loads = [0] * n
    for it in sorted(items, key=lambda i: -i.nbytes):
        j = min(range(n), key=lambda k: loads[k])
        bins[j].append(it)
        loads[j] += it.nbytes
    return [sorted(b, key=_file_order) for b in bins if b]


def _file_order(it: WriteItem) -> tuple[int, str, tuple[int, ...]]:
    """Widest dtypes first: with the header padded to 8 bytes, every chunk then starts at a
    multiple of its item size, so readers can view the bytes as the dtype without a copy."""
    return (-DTYPES[it.dtype][1], it.key, it.offsets)


@dataclass
class WriteResult:
    chunks: dict[str, list[ChunkRecord]]
    files: dict[str, dict[str, Any]]
    bytes_written: int


def _write_one(
    storage: Storage,
    step_dir: str,
    rel: str,
    items: Sequence[WriteItem],
    rank: int,
    algorithm: str,
    block_bytes: int,
) -> tuple[list[tuple[str, ChunkRecord]], int]:
    entries = [
        (chunk_name(i.key, i.offsets, i.shape, i.global_shape), i.dtype, i.shape, i.nbytes)
        for i in items
    ]
    header, file_offsets = build_header(entries, {"format": "pt", "writer": "shardkeeper"})
    digest = digest_function(algorithm)
    writer = storage.open_writer(f"{step_dir}/{rel}")
    out = []
    try:
        writer.write(header)
        for it, off in zip(items, file_offsets):
            assert it.staged is not None
            view = memoryview(cast("Buffer", it.staged.numpy()))
            digests = []
            for b in range(0, it.nbytes, block_bytes):
                block = view[b : b + block_bytes]
                digests.append(digest(block))
                writer.write(block)
            out.append(
                (
                    it.key,
                    ChunkRecord(rel, off, it.nbytes, it.offsets, it.shape, tuple(digests)),
                )
            )
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return out, len(header) + sum(i.nbytes for i in items)


def write_shards(
    storage: Storage,
    step_dir: str,
    items: Sequence[WriteItem],
    *,
    rank: int,
    attempt: str,
    algorithm: str,
    block_bytes: int,
    executor: Executor,
    max_files: int,
    min_file_bytes: int,
) -> WriteResult:
    """Write the staged items into this rank's shard files, in parallel, durably."""
    groups = _split_files(items, max_files, min_file_bytes) if items else []
    futures = [
        executor.submit(
            _write_one, storage, step_dir, shard_file(rank, attempt, i), g, rank, algorithm, block_bytes
        )
        for i, g in enumerate(groups)
    ]
    chunks: dict[str, list[ChunkRecord]] = {}
    files: dict[str, dict[str, Any]] = {}
    written = 0
    errors = []
    for i, f in enumerate(futures):
        try:
            recs, size = f.result()
        except BaseException as e:  # collect all, raise the first
            errors.append(e)
            continue
        files[shard_file(rank, attempt, i)] = {"size_bytes": size, "rank": rank}
        written += size
        for key, rec in recs:
            chunks.setdefault(key, []).append(rec)
    if errors:
        raise errors[0]
    if groups:
        storage.sync_dir(f"{step_dir}/{DATA_DIR}")
        storage.sync_dir(step_dir)
    return WriteResult(chunks, files, written)
