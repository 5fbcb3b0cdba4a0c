"""Import a ``torch.distributed.checkpoint`` (DCP) directory as a committed shardkeeper step.

A DCP directory's ``.metadata`` is a pickle, and so are its non-tensor entries: reading them
can run code. They are read only when the caller passes ``trust_pickle=True``, the bool
(``legacy.require_trust``: refused otherwise, before any file is opened).

Streaming, in one process: the tensor list (keys, dtypes, global shapes) comes from the
metadata; tensors are loaded by DCP in batches of at most ``batch_bytes`` (DCP assembles each
full tensor from the saved shards, whatever the saving layout was) and each batch becomes one
shard file, written and digested as the manager writes its own. Memory stays near
``batch_bytes`` (or the largest tensor). The manifest is then committed with put-if-absent.

Keys: DCP's nested paths joined with ``/``, each part FQN-normalized (``model/<fqn>``,
``optim/state/<fqn>/<name>``), so a DCP save of ``{"model": ..., "optim": ...}`` from
``get_state_dict`` restores into a ``{"model": module, "optim": optimizer}`` state. Two
entries that map to one key (``model.module.x`` and ``model.x``; a tensor and an object) are
refused before anything is written.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.digest import DEFAULT_ALGORITHM, DEFAULT_BLOCK_BYTES
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.save.imported import ImportedStep
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.flatten import normalize_fqn, torch_dtype_name
from shardkeeper.core.state.unpickle import require_trust
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar

DEFAULT_BATCH_BYTES = 512 << 20


def _refuse_untrusted(src: str, trust_pickle: bool) -> None:
    require_trust(
        src,
        trust_pickle=trust_pickle,
        why=("it is a torch.distributed.checkpoint directory, whose .metadata and non-tensor entries are pickles"),
    )
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise FileNotFoundError(f"{src}: no .metadata file; not a torch.distributed.checkpoint directory")


def read_dcp_metadata(path: str | os.PathLike[str], *, trust_pickle: bool) -> Any:
    """DCP's ``Metadata`` of ``path`` (unpickled: refused unless ``trust_pickle is True``)."""
    from torch.distributed.checkpoint import FileSystemReader

    src = os.fspath(path)
    _refuse_untrusted(src, trust_pickle)
    return FileSystemReader(src).read_metadata()


def load_dcp(path: str | os.PathLike[str], *, trust_pickle: bool, keys: set[str] | None = None) -> dict[str, Any]:
    """The nested state dict DCP saved at ``path`` (only the flat DCP ``keys`` if given), read
    whole in this process without a process group; full tensors, whatever the saving layout."""
    from torch.distributed.checkpoint import FileSystemReader

    src = os.fspath(path)
    _refuse_untrusted(src, trust_pickle)
    sd: dict[str, Any] = {}
    tc.load_dcp_state_dict(sd, FileSystemReader(src), keys)
    return sd


def canonical_key(path: Sequence[Any]) -> str:
    """A DCP object path (``("model", "module.fc.weight")``) as a shardkeeper key."""
    return "/".join(normalize_fqn(str(p)) for p in path)


def _jsonable(value: Any, key: str, src: str) -> Any:
    if isinstance(value, torch.Tensor):
        raise StateMismatchError(
            f"{src}: entry {key!r} holds a tensor inside a non-tensor value; not imported by this version"
        )
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, key, src) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key, src) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value  # non-finite ones too: the manifest keeps them (format.md 3, "Exact values")
    raise StateMismatchError(
        f"{src}: entry {key!r} is a {type(value).__name__}, not a JSON value; shardkeeper stores no "
        f"pickles: convert it before saving, or import the tensors only"
    )


def _object_leaves(tree: Any, prefix: list[str], raw: list[str], src: str) -> Iterator[tuple[str, Any, str]]:
    """Non-tensor entries as object leaves ``(key, value, DCP key)``: mappings are walked,
    anything else is one leaf; ``params`` lists of optimizer groups are FQN-normalized. The
    DCP key is the entry's path as DCP flattens it (parts joined with ``.``, not normalized)."""
    if isinstance(tree, Mapping) and tree:
        for k, v in tree.items():
            yield from _object_leaves(v, [*prefix, normalize_fqn(str(k))], [*raw, str(k)], src)
        return
    key = "/".join(prefix)
    value = _jsonable(tree, key, src)
    if isinstance(value, list):
        for g in value:
            if isinstance(g, dict) and isinstance(g.get("params"), list):
                g["params"] = [normalize_fqn(p) if isinstance(p, str) else p for p in g["params"]]
    yield key, value, ".".join(raw)


def _claim(origin: dict[str, str], key: str, entry: str, src: str) -> None:
    """Record that DCP entry ``entry`` becomes ``key``; refuse a second entry for the same key."""
    if key in origin:
        raise StateMismatchError(
            f"{src}: DCP entries {origin[key]!r} and {entry!r} both map to the shardkeeper key {key!r} "
            f"(wrapper prefixes such as 'module.' are dropped from every part); importing both would lose "
            f"one, so nothing was imported. Load the DCP checkpoint, rename or drop one of them, and save it "
            f"again before importing"
        )
    origin[key] = entry


def _batches(
    tensors: list[tuple[str, str, tuple[int, ...], str, int]], limit: int
) -> list[list[tuple[str, str, tuple[int, ...], str, int]]]:
    out: list[list[tuple[str, str, tuple[int, ...], str, int]]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t[4] > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t[4]
    return [b for b in out if b]


def _get(tree: Any, path: Sequence[Any]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def import_dcp(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | Storage,
    *,
    step: int,
    trust_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    digest: str = DEFAULT_ALGORITHM,
    digest_block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: bool | None = None,
) -> Manifest:
    """Write the DCP checkpoint at ``path`` as committed step ``step`` under ``root``; run it in
    one process. Returns the committed manifest. Fails (``CommitConflictError``) if the step
    is already committed there; ``PermissionError`` unless ``trust_pickle is True``, before any
    file is read; ``StateMismatchError`` if two DCP entries map to one key, before any is written."""
    src = os.fspath(path)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    md = read_dcp_metadata(src, trust_pickle=trust_pickle)
    warnings.warn(
        f"unpickling {src}/.metadata (trust_pickle=True): only do this for checkpoints you trust", stacklevel=2
    )
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors: list[tuple[str, str, tuple[int, ...], str, int]] = []  # flat key, key, shape, dtype, bytes
    object_keys: set[str] = set()
    origin: dict[str, str] = {}  # shardkeeper key -> the DCP entry it comes from
    for flat, meta in md.state_dict_metadata.items():
        obj_path = (md.planner_data or {}).get(flat, (flat,))
        key = canonical_key(obj_path)
        if isinstance(meta, TensorStorageMetadata):
            dtype = torch_dtype_name(meta.properties.dtype)
            if dtype not in DTYPES:
                raise StateMismatchError(
                    f"{src}: tensor {flat!r} has dtype {dtype}, which the shardkeeper format does not store"
                )
            _claim(origin, key, flat, src)
            shape = tuple(int(s) for s in meta.size)
            tensors.append((flat, key, shape, dtype, math.prod(shape) * DTYPES[dtype][1]))
        elif isinstance(meta, BytesStorageMetadata):
            object_keys.add(flat)
    storage = open_storage(root, **dict(storage_options or {}))
    out = ImportedStep(storage, step, source=src, digest=digest, digest_block_bytes=digest_block_bytes)
    bar = make_bar(sum(t[4] for t in tensors), f"import {os.path.basename(src.rstrip('/')) or src}", progress)
    try:
        with out:
            if object_keys:  # before any tensor is written: a key collision loses nothing
                objs = load_dcp(src, trust_pickle=trust_pickle, keys=object_keys)
                for key, value, entry in _object_leaves(objs, [], [], src):
                    _claim(origin, key, entry, src)
                    out.add_object(key, value)
            for batch in _batches(tensors, max(1, batch_bytes)):
                loaded = load_dcp(src, trust_pickle=trust_pickle, keys={t[0] for t in batch})
                out.write(
                    [
                        (key, _get(loaded, (md.planner_data or {}).get(flat, (flat,))).detach().to("cpu").contiguous())
                        for flat, key, *_ in batch
                    ]
                )
                bar.update(sum(t[4] for t in batch))
                del loaded
            return out.commit(
                {
                    "imported_from": src,
                    "imported_format": "torch.distributed.checkpoint",
                    **dict(metadata or {}),
                }
            )
    finally:
        bar.close()


__all__ = ["DEFAULT_BATCH_BYTES", "canonical_key", "import_dcp", "load_dcp", "read_dcp_metadata"]
