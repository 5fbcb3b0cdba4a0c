"""The safetensors header checks of ``verify`` (verify/checks.py): a step's own unencoded shard
files carry a header naming each chunk's tensor, dtype, shape and byte range, which must agree
with the manifest's records. Torch-free."""

from __future__ import annotations

import json
import struct

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.records import DTYPES, ChunkRecord, LeafRecord
from shardkeeper.core.format.safetensors import FRAMED_MAGIC, chunk_name
from shardkeeper.core.format.untrusted import UntrustedJSONError, loads_untrusted
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify.report import Collector, problem_kind, rng

#: A safetensors header larger than this is taken for damage (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000
_rng = rng


def check_header(
    storage: Storage,
    step: int,
    path: str,
    size: int,
    entries: list[tuple[str, LeafRecord, ChunkRecord]],
    out: Collector,
) -> None:
    where = storage.describe(path)
    if size < 8:
        out.add(
            "header",
            f"step {step}: {where} is {size} bytes, too short for a safetensors header",
            file=path,
            start=0,
            end=8,
        )
        return
    try:
        first = storage.read_range(path, 0, 8)
        if first == FRAMED_MAGIC:  # a framed file (compression on): no header to cross-check
            return
        (n,) = struct.unpack("<Q", first)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            out.add(
                "header",
                f"step {step}: {where}: safetensors header length {n} does not fit the file ({size} bytes)",
                file=path,
                start=0,
                end=8,
            )
            return
        header = loads_untrusted(storage.read_range(path, 8, n), max_bytes=_MAX_HEADER_BYTES)
    except CheckpointError as e:  # damage (the entry, or bytes that fail authentication), a key, or the storage
        out.add(problem_kind(e, "header"), f"step {step}: reading the header of {where} failed: {e}", file=path)
        return
    except UntrustedJSONError as e:
        out.add("header", f"step {step}: {where}: the safetensors header {e}", file=path, start=8)
        return
    if not isinstance(header, dict):
        out.add(
            "header", f"step {step}: {where}: the safetensors header is not an object", file=path, start=8, end=8 + n
        )
        return
    data_start = 8 + n
    for key, leaf, c in entries:
        name = chunk_name(key, c.offsets, c.shape, leaf.shape)
        entry = header.get(name)
        want = {
            "dtype": DTYPES[leaf.dtype][0],
            "shape": list(c.shape),
            "data_offsets": [c.offset - data_start, c.offset - data_start + c.length],
        }
        rng = _rng(c.offset, c.offset + c.length)
        if not isinstance(entry, dict):
            out.add(
                "header",
                f"step {step}: leaf {key}, file {where}, bytes {rng}: the safetensors header has no tensor {name!r}",
                key=key,
                file=path,
                start=c.offset,
                end=c.offset + c.length,
                expected=name,
                found="absent",
            )
            continue
        got = {k: entry.get(k) for k in want}
        if got != want:
            out.add(
                "header",
                f"step {step}: leaf {key}, file {where}, bytes {rng}: the "
                f"safetensors header says {json.dumps(got)} for {name!r}, the manifest "
                f"{json.dumps(want)}",
                key=key,
                file=path,
                start=c.offset,
                end=c.offset + c.length,
                expected=json.dumps(want),
                found=json.dumps(got),
            )


__all__ = ["check_header"]
