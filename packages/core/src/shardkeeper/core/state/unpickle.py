"""The one place shardkeeper unpickles: legacy checkpoints, on the caller's explicit trust.

shardkeeper's own format holds no pickle and restore never unpickles. Importers of checkpoints
written by other tools (a Lightning ``.ckpt``, DeepSpeed's ``global_step*/`` files, an
Accelerate ``save_state`` folder, a ``torch.distributed.checkpoint`` directory) must read those
pickles once to convert them. Every importer calls ``require_trust`` first, before it opens a
file or hands the checkpoint to a converter or a framework's loader, and it passes only when
``trust_pickle is True``: the bool, not a truthy value (``"false"``, ``1`` and ``"yes"`` are
refused). ``load_trusted_pickle`` reads one pickle file behind the same gate;
``possible_pickles`` lists the files of a folder that a loader may unpickle.
"""

from __future__ import annotations

import os
import pickle  # only for the restricted unpickler's error type
from typing import Any

import torch

#: Files a loader reads without unpickling, by how their names end: safetensors, JSON and text
#: (DeepSpeed's ``latest`` tag file has no suffix). Loaders choose the reader by the name, so
#: any other file (``.metadata``, ``*.pt``, ``*.bin``, ``*.pkl``, ``*.pth``, ``*.distcp``, or a
#: name never seen before) may be unpickled.
SAFE_SUFFIXES = (".safetensors", ".json", ".txt")
SAFE_NAMES = frozenset({"latest"})


def require_trust(path: str | os.PathLike[str], *, trust_pickle: object, why: str = "it is a pickle") -> None:
    """The gate: ``PermissionError`` naming ``path`` unless ``trust_pickle is True``.

    ``why`` says what in ``path`` is pickled. Call it before anything under ``path`` is read.
    """
    if trust_pickle is True:
        return
    got = "" if trust_pickle is False or trust_pickle is None else f" (trust_pickle={trust_pickle!r} is not True)"
    raise PermissionError(
        f"{os.fspath(path)}: {why}, and unpickling can run code from the file; shardkeeper "
        f"reads it only when you pass trust_pickle=True (CLI: --trust-pickle), and only for "
        f"files you trust{got}"
    )


def is_known_safe(name: str) -> bool:
    """Whether a file named ``name`` is one a loader reads without unpickling."""
    return name.endswith(SAFE_SUFFIXES) or name in SAFE_NAMES


def possible_pickles(folder: str | os.PathLike[str]) -> list[str]:
    """The files under ``folder``, at any depth, that are not known-safe (``is_known_safe``),
    as paths relative to it, sorted. Symlinked folders are followed (once each), as a loader
    follows them; a folder that cannot be listed counts as one entry (``<dir>/``)."""
    root = os.fspath(folder)
    found: list[str] = []
    seen: set[str] = set()

    def unreadable(e: OSError) -> None:
        found.append(os.path.relpath(e.filename or root, root) + "/")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames.clear()
            continue
        seen.add(real)
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if not is_known_safe(f)]
    return sorted(found)


def load_trusted_pickle(path: str | os.PathLike[str], *, trust_pickle: object) -> Any:
    """``torch.load`` of a legacy pickle file, on CPU; ``PermissionError`` unless trusted.

    Even when trusted, torch's restricted ``weights_only`` unpickler (tensors, containers and
    primitives; it runs no code) is tried first; full unpickling happens only for files that
    hold other objects (a Lightning ``.ckpt``'s hyperparameters, DeepSpeed's client state).
    """
    require_trust(path, trust_pickle=trust_pickle)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, map_location="cpu", weights_only=False)


__all__ = ["SAFE_NAMES", "SAFE_SUFFIXES", "is_known_safe", "load_trusted_pickle", "possible_pickles", "require_trust"]
