"""The synthetic layouts of case (e) and of the world-size sweep, and DCP's metadata for them.

One layout feeds both sides, so shardkeeper's manifest and DCP's ``.metadata`` describe the
same chunks: ``tensors`` float32 tensors of ``ROWS(ranks)`` x 256, either row-sharded over
every rank (FSDP) or each owned whole by one rank (tensor ``i`` by rank ``i % ranks``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

COLS = 256
ITEM = 4  # float32
BLOCK = 65536  # digest block bytes
HEADER = 4096  # where a rank's first chunk starts in its file


def n_rows(ranks: int) -> int:
    """Rows of every tensor: 1024, or the world size when larger (every rank gets >= 1 row)."""
    return max(1024, ranks)


def key(i: int) -> str:
    return f"model/layers.{i // 100}.block.{i % 100}.weight"


def row_split(rows: int, ranks: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s rows ``(start, count)`` by ``torch.chunk``'s rule (FSDP2's): pieces of
    ``ceil(rows / ranks)`` rows, the last smaller; ranks past the end get none (count 0)."""
    size = -(-rows // ranks)
    start = min(rows, r * size)
    return start, min(rows, start + size) - start


def rank_chunks(ranks: int, tensors: int, layout: str, r: int) -> Iterator[tuple[int, int, int, int]]:
    """Rank ``r``'s chunks in file order: ``(tensor index, first row, rows, file offset)``."""
    rows = n_rows(ranks)
    at = HEADER
    if layout == "sharded":
        start, count = row_split(rows, ranks, r)
        if count == 0:
            return
        n = count * COLS * ITEM
        for i in range(tensors):
            yield i, start, count, at
            at += n
    else:
        n = rows * COLS * ITEM
        for i in range(r, tensors, ranks):
            yield i, 0, rows, at
            at += n


def dcp_figures(ranks: int, tensors: int, layout: str, path: str, repeats: int) -> dict[str, Any]:
    """DCP's ``.metadata`` for the same chunks, as ``FileSystemWriter`` writes it (a pickled
    ``Metadata``: a ``TensorStorageMetadata`` per key, ``storage_data`` mapping each chunk's
    ``MetadataIndex`` to its ``_StorageInfo``, ``planner_data`` the flattening map), its size,
    pickle and unpickle times, and rank 0's load planning (read + unpickle the file, then
    ``create_default_local_load_plan``) for its own shard (whole: every tensor)."""
    import torch
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows = n_rows(ranks)
    size = torch.Size([rows, COLS])
    fqns = [key(i).replace("/", ".") for i in range(tensors)]
    chunk_lists: list[list[Any]] = [[] for _ in range(tensors)]
    storage: dict[Any, Any] = {}
    for r in range(ranks):
        rel = f"__{r}_0.distcp"
        for i, start, count, at in rank_chunks(ranks, tensors, layout, r):
            offsets = torch.Size([start, 0])
            idx = len(chunk_lists[i])
            chunk_lists[i].append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([count, COLS])))
            storage[MetadataIndex(fqns[i], offsets, idx)] = _StorageInfo(rel, at, count * COLS * ITEM)
    sdm = {
        f: TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=size, chunks=cs)
        for f, cs in zip(fqns, chunk_lists)
    }
    planner = {f: tuple(f.split(".", 1)) for f in fqns}
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, storage_meta=StorageMeta())
    pickle_s, unpickle_s, plan_s, plan_cpu = [], [], [], []
    data = b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = pickle.dumps(md)
        pickle_s.append(time.perf_counter() - t0)
    with open(path, "wb") as f:
        f.write(data)
    # a loading process does not hold the saver's Metadata: with it alive, the collector's
    # passes over its millions of objects would double the unpickle time at 800,000 chunks
    del md, sdm, storage, chunk_lists
    for _ in range(repeats):
        t0 = time.perf_counter()
        pickle.loads(data)
        unpickle_s.append(time.perf_counter() - t0)
    # rank 0's state dict: what DCP's planner asks of a DTensor (its global size, its local chunk)
    start, count = row_split(rows, ranks, 0) if layout == "sharded" else (0, rows)
    local = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([count, COLS]))
    state = {f: _Shard(size, local) for f in fqns}  # whole: every tensor, as shardkeeper's plan
    items = 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with open(path, "rb") as f:
            loaded = pickle.load(f)  # FileSystemReader.read_metadata
        plan = create_default_local_load_plan(state, loaded, strict=True)
        plan_s.append(time.perf_counter() - t0)
        plan_cpu.append(time.process_time() - c0)
        items = len(plan.items)
        del loaded, plan
    return {
        "dcp_metadata_bytes": len(data),
        "dcp_pickle_s": _median(pickle_s),
        "dcp_unpickle_s": _median(unpickle_s),
        "dcp_plan_s": _median(plan_s),
        "dcp_plan_cpu_s": _median(plan_cpu),
        "dcp_plan_items": items,
    }


class _Shard:
    """What ``create_default_local_load_plan`` asks of a rank's DTensor: ``size()`` (global)
    and ``__create_chunk_list__()`` (its local chunk); no device mesh needed."""

    def __init__(self, size: Any, chunk: Any) -> None:
        self._size, self._chunk = size, chunk

    def size(self) -> Any:
        return self._size

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
