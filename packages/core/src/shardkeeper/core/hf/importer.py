"""``import_hf``: a Hugging Face safetensors folder as a committed step (``shardkeeper import``).

The folder's tensors (selected, renamed and tied as ``load_hf`` does it, hf/view.py) are
read in batches of at most ``batch_bytes`` into full CPU tensors of their stored dtype, by
restore's reader (ranged reads of the folder's byte ranges, checked against the headers'
bounds), and each batch is written as one shard file by the importers' step writer
(``save/imported.py``: digested as a save digests, committed with put-if-absent). No cast,
no pickle: the step holds the folder's bytes, bit for bit, under ``prefix`` + name
(``model/<name>`` by default, which ``restore({"model": model})`` fills).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.digest import DEFAULT_ALGORITHM, DEFAULT_BLOCK_BYTES
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.hf.folder import REMEDY, Folder
from shardkeeper.core.hf.load import SOURCE, open_folder
from shardkeeper.core.hf.view import Rename, as_manifest, select, target_keys
from shardkeeper.core.restore.flat import restore_flat
from shardkeeper.core.restore.plan import listing
from shardkeeper.core.save.imported import ImportedStep, batches
from shardkeeper.core.state.flatten import FlatState, Leaf, dtype_from_name
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar

DEFAULT_BATCH_BYTES = 512 << 20


def import_hf(
    path: str | os.PathLike[str] | Storage,
    root: str | os.PathLike[str] | Storage,
    *,
    step: int,
    prefix: str = "model/",
    rename: Rename = None,
    only: str | Sequence[str] | None = None,
    tied: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    digest: str = DEFAULT_ALGORITHM,
    digest_block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: bool | None = None,
) -> Manifest:
    """Write the safetensors folder at ``path`` as committed step ``step`` under ``root`` (its
    ``storage_options``), in one process; the committed manifest. ``prefix``, ``rename``,
    ``only``, ``tied``: as ``load_hf``'s. A step already committed is a ``CommitConflictError``
    and a dtype the format lacks a ``StateMismatchError``, both before anything is written."""
    opts = CheckpointOptions()
    src, folder_dir = open_folder(path, None, opts)
    where = src.describe(folder_dir)
    folder = Folder(src, folder_dir)
    patterns = [only] if isinstance(only, str) else (list(only) if only else None)
    sources = select(folder.weight_map, tied, patterns, where)
    keys = target_keys(sources, rename, prefix, where)
    found = folder.tensors({sources[n] for n in keys.values()})
    by_key = {k: found[sources[n]] for k, n in keys.items()}
    unknown = [f"{n!r} ({by_key[k].code})" for k, n in keys.items() if by_key[k].dtype is None]
    if unknown:
        raise StateMismatchError(
            f"{len(unknown)} tensor(s) of {where} have a dtype the shardkeeper format does not store: "
            f"{listing(unknown, 8)}; leave them out with only=[...]; nothing was imported"
        )
    source = as_manifest(by_key, folder.sizes)
    order = sorted(keys, key=lambda k: (by_key[k].file, by_key[k].offset))  # each file front to back
    storage = open_storage(root, **dict(storage_options or {}))
    bar = make_bar(sum(t.length for t in by_key.values()), f"import {os.path.basename(where.rstrip('/'))}", progress)
    try:
        with ImportedStep(storage, step, source=where, digest=digest, digest_block_bytes=digest_block_bytes) as out:
            with ThreadPoolExecutor(opts.io_threads, thread_name_prefix="shardkeeper-io") as io:
                for batch in batches([(k, by_key[k].length) for k in order], max(1, batch_bytes)):
                    full = {
                        k: torch.empty(by_key[k].shape, dtype=dtype_from_name(source.leaves[k].dtype)) for k in batch
                    }
                    flat = FlatState(leaves={k: Leaf(k, t, "tensor") for k, t in full.items()})
                    restore_flat(
                        src,
                        folder_dir,
                        source,
                        flat,
                        rank=0,
                        world_size=1,
                        only=None,
                        strict=True,
                        per_rank="exact",
                        cast=False,
                        executor=io,
                        max_read_bytes=opts.max_read_bytes,
                        source=SOURCE,
                        remedy=REMEDY,
                        verify=False,
                    )
                    out.write(list(full.items()))
                    bar.update(sum(by_key[k].length for k in batch))
                    del full, flat
            return out.commit({"imported_from": where, "imported_format": "safetensors", **dict(metadata or {})})
    finally:
        bar.close()


__all__ = ["DEFAULT_BATCH_BYTES", "import_hf"]
