"""Target-free load: a committed step read into a new nested dict (``CheckpointManager.load``).

Like ``torch.load`` or a restore without a target: no model or optimizer is needed, and a
step saved by any number of ranks in any layout (DDP, FSDP, TP, ZeRO fragments) comes back
whole in one process. The target is made from the manifest, one full CPU tensor of the saved
shape and dtype per tensor leaf, and filled by the restore machinery itself
(``restore/flat.py``: planned overlaps of every rank's chunks, ranged, verified reads,
decoding of compressed and encrypted chunks), so there is one reader, not two.

The dict is nested by the ``/`` key paths, as the state was given: ``{"model": {"fc.weight":
tensor}, "meta": {"step": 3}}``. Lists and tuples that held tensors come back as dicts keyed
``"0"``, ``"1"``, ...; per-rank state (``PerRank``, ``RNGState``) as it is stored, one entry
per saving rank: ``{"rng": {"0": {...}, "1": {...}}}``. A quantized optimizer entry comes back
as stored (its int8 values and scales).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from shardkeeper.core.codec.read import size_or_none
from shardkeeper.core.commit.committed import newest_committed
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import CheckpointNotFoundError, CheckpointRestoreError, CorruptCheckpointError
from shardkeeper.core.format.bounds import max_decoded_bytes, stored_bytes_problem
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest, itemsize
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.restore.flat import restore_flat
from shardkeeper.core.restore.logical_check import judge, warn_marked
from shardkeeper.core.restore.plan import RestoreStats, listing, matches
from shardkeeper.core.restore.restorer import readable_manifest
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.state.flatten import FlatState, Leaf, dtype_from_name
from shardkeeper.core.util.sizes import human_size


def _head(manifest: Manifest, key: str) -> Any:
    """Leaf ``key``'s record without materializing a table-form manifest's chunk records."""
    leaves = manifest.leaves
    return leaves.head(key) if isinstance(leaves, TableLeaves) else leaves[key]


def _nbytes(rec: Any) -> int:
    return 0 if rec.kind == "object" else math.prod(rec.shape) * itemsize(rec.dtype)


class _Put:
    """Sets one leaf's value at its key path in the nested result (a leaf setter)."""

    __slots__ = ("parent", "name")

    def __init__(self, parent: dict[str, Any], name: str) -> None:
        self.parent = parent
        self.name = name

    def __call__(self, value: Any) -> None:
        self.parent[self.name] = value


def _slot(out: dict[str, Any], key: str) -> _Put:
    """The container and name of ``key`` in ``out`` (``a/b/c``: ``out["a"]["b"]``, ``"c"``).
    Keys are checked first (``_nesting_clash``), so every path on the way is a dict."""
    *path, name = key.split("/")
    node = out
    for part in path:
        node = node.setdefault(part, {})
    return _Put(node, name)


def _nesting_clash(keys: Sequence[str]) -> tuple[str, str] | None:
    """Two keys of which one lies under the other (``lr`` and ``lr/warmup``): a nested dict
    cannot hold a value and keys under it at one path. A state saved from a dict whose keys
    hold ``/`` has them; ``restore()`` into such a target reads them, a nested result cannot."""
    present = set(keys)
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in present:
                return prefix, key
    return None


def _check_backed(ctx: ManagerContext, manifest: Manifest, records: dict[str, Any], where: str) -> None:
    """Before any leaf is allocated: the step's files must be able to hold every tensor and
    bytes leaf of ``records`` (docs/format.md 12). The manifest alone sizes what ``load()``
    allocates, so a forged shape would otherwise become an allocation nothing backs. Each
    leaf's chunks (a described leaf's read from its ranks' index files, as the restore reads
    them next) must lie in files that exist and hold them, the chunks of all the leaves
    together no more stored bytes than their files hold (no writer stores a byte for two
    chunks), and the leaf no more bytes than its chunks decode to (raw: their length; zstd:
    ``max_decoded_bytes``)."""
    keys = [k for k, r in records.items() if r.kind != "object" and _nbytes(r)]
    found = _chunks_of(manifest.leaves, keys, records)
    sizes: dict[str, int | None] = {}
    held = stored = 0

    def size_of(file: str) -> int | None:
        nonlocal held
        if file not in sizes:
            path = resolve_file(manifest.step, file)
            got = sizes[file] = None if path is None else size_or_none(ctx.storage, path)
            held += got or 0
        return sizes[file]

    for key, chunks in zip(keys, found):
        rec = records[key]
        why = stored_bytes_problem(chunks, size_of)
        decodes = 0
        for c in chunks:
            stored += c.length
            decodes += c.length if c.encoding == "raw" else max_decoded_bytes(c.length)
        if why is None and decodes < _nbytes(rec):
            why = f"its {len(chunks)} chunks decode to at most {decodes} bytes"
        if why is None and stored > held:
            why = (
                f"with it the leaves' chunks claim {stored} stored bytes, more than the {held} their "
                f"{len(sizes)} file(s) hold: chunks of two leaves share stored bytes, which no writer does"
            )
        if why is not None:
            raise CorruptCheckpointError(
                f"load(): {where}: {rec.kind} leaf {key!r} ({rec.dtype} {list(rec.shape)}, {_nbytes(rec)} bytes) "
                f"is more than the files of {ctx.storage.describe(step_dir(manifest.step))} can hold: {why}; the "
                f"checkpoint is damaged, nothing was allocated or read: load another step and run `shardkeeper "
                f"verify {ctx.storage.url} {manifest.step}`"
            )


class _Span(NamedTuple):
    """The stored bytes of one chunk (what ``stored_bytes_problem`` and the bound read)."""

    file: str
    offset: int
    length: int
    encoding: str


def _chunks_of(leaves: Any, keys: list[str], records: dict[str, Any]) -> list[Sequence[Any]]:
    """The chunks of each of ``keys``: a table-form leaf's read from the columns (no records
    made: the restore makes those next), described leaves' derived in one batch (their index
    files read once: the restore reuses them), any other leaf's from its record."""
    if not isinstance(leaves, TableLeaves):
        return [leaves[k].chunks for k in keys]
    lt, t = leaves.leaf_table, leaves.table
    enc = t.extras.get("encoding") or [None] * len(t.length)
    out: list[Sequence[Any]] = []
    rest = []
    for k in keys:
        j = lt.index.get(k)
        if j is None:
            rest.append(len(out))
            out.append(())
        else:
            rows = lt.rows_of(j)
            out.append([_Span(t.paths[t.file[i]], t.offset[i], t.length[i], enc[i] or "raw") for i in rows])
    if rest:
        boxes = [(keys[n], (0,) * len(records[keys[n]].shape), records[keys[n]].shape) for n in rest]
        for n, got in zip(rest, leaves.overlapping_many(boxes)):
            out[n] = got
    return out


def _allocate(rec: Any, key: str, where: str) -> torch.Tensor:
    """Leaf ``key``'s result tensor; an allocation this machine cannot make is named."""
    try:
        return torch.empty(tuple(rec.shape), dtype=dtype_from_name(rec.dtype))
    except (RuntimeError, MemoryError) as e:
        raise CheckpointRestoreError(
            f"load(): {where}: tensor leaf {key!r} ({rec.dtype} {list(rec.shape)}) takes {_nbytes(rec)} bytes "
            f"({human_size(_nbytes(rec))}), which this process cannot allocate ({type(e).__name__}: "
            f"{str(e)[:200]}); nothing was read. Load a part with only=[...] or on a machine with more memory"
        ) from e


def resolve_step(ctx: ManagerContext, step: int | None) -> int:
    """``step``, or the newest committed one (a ``CheckpointNotFoundError`` when none is)."""
    if step is not None:
        return step
    newest = newest_committed(ctx.storage)
    if newest is None:
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {ctx.storage.url}; nothing to load. Check the root "
            f"(`shardkeeper ls {ctx.storage.url}`)"
        )
    return newest


def load_step(
    ctx: ManagerContext, step: int | None, only: Sequence[str] | None, max_bytes: int | None
) -> tuple[dict[str, Any], RestoreStats]:
    """``step`` (None: the newest committed) as a new nested dict, and what was read.

    ``only``: key patterns as ``restore``'s; ``max_bytes``: refuse, before allocating or
    reading anything, when the selected tensors and bytes would take more memory than this.
    """
    step = resolve_step(ctx, step)
    url = ctx.storage.url
    where = f"step {step} under {url}"
    manifest = readable_manifest(ctx, step)
    keys = [k for k in manifest.leaves if matches(k, only)]
    if only and not keys:
        raise CheckpointRestoreError(
            f"load(): only={list(only)} matches no key of {where}; list its keys with "
            f"`shardkeeper inspect {url} {step}`"
        )
    clash = _nesting_clash(keys)
    if clash is not None:
        raise CheckpointRestoreError(
            f"load(): {where} holds both {clash[0]!r} and {clash[1]!r}, so one is a value and a prefix of "
            f"the other: a nested dict cannot hold both (a key with '/' in it, saved from a dict); nothing "
            f"was read. Restore into a target that has both (restore(state, step={step})), or load the "
            f"other keys with only=[...] leaving one of them out"
        )
    records = {k: _head(manifest, k) for k in keys}
    total = sum(_nbytes(r) for r in records.values())
    if max_bytes is not None and total > max_bytes:
        big = sorted(records, key=lambda k: -_nbytes(records[k]))[:4]
        raise CheckpointRestoreError(
            f"load(): the selected tensors of {where} take {total} bytes ({human_size(total)}), more "
            f"than max_bytes={max_bytes} ({human_size(max_bytes)}); nothing was read. The largest: "
            f"{listing([f'{k} ({human_size(_nbytes(records[k]))})' for k in big], 4)}. Load a part "
            f"with only=['model/*'], or pass a larger max_bytes= (None: no bound)"
        )
    _check_backed(ctx, manifest, records, where)
    out: dict[str, Any] = {}
    flat = FlatState()
    for key, rec in records.items():
        put = _slot(out, key)
        if rec.kind == "tensor":
            tensor = _allocate(rec, key, where)
            put(tensor)
            flat.leaves[key] = Leaf(key, tensor, "tensor")
        else:  # bytes and JSON values are set once every read succeeded
            flat.leaves[key] = Leaf(key, None, rec.kind, set=put)
    stats = restore_flat(
        ctx.storage,
        step_dir(step),
        manifest,
        flat,
        rank=0,
        world_size=1,
        only=None,
        strict=True,
        per_rank="exact",  # per-rank keys are read as stored (every leaf's per_rank is None)
        cast=False,
        executor=ctx.io,
        max_read_bytes=ctx.settings.max_read_bytes,
        logical=ctx.settings.logical_check != "off",
    )
    err = judge(ctx, stats.logical, step, collective=False)
    if err is not None:
        raise err
    stats.replicas_disagree = warn_marked(ctx, manifest, f"load() of step {step} under {url}")
    return out, stats


__all__ = ["load_step", "resolve_step"]
