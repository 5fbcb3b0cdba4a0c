"""The one place shardkeeper unpickles: legacy checkpoints, on the caller's explicit trust.

shardkeeper's own format holds no pickle and restore never unpickles. Importers of checkpoints
written by other tools (a Lightning ``.ckpt``, DeepSpeed's ``global_step*/`` files) must read
those pickles once to convert them; they do it only through this module, which refuses
unless the caller passed ``trust_pickle=True``, so the opt-in cannot be skipped by a code path:
``load_trusted_pickle`` for a file torch.load reads, ``require_trust`` before handing a pickle
to a reader that unpickles it itself (torch.distributed.checkpoint's ``.metadata``).
"""

from __future__ import annotations

import os
import pickle  # only for the restricted unpickler's error type
from typing import Any

import torch


def require_trust(what: str, *, trust_pickle: bool) -> None:
    """``PermissionError`` unless ``trust_pickle is True``; ``what`` says which pickle and why."""
    if trust_pickle is not True:
        raise PermissionError(
            f"{what} is a pickle, which can run code when loaded; shardkeeper reads it only when "
            f"you pass trust_pickle=True (CLI: --trust-pickle) for files you trust"
        )


def load_trusted_pickle(path: str | os.PathLike[str], *, trust_pickle: bool) -> Any:
    """``torch.load`` of a legacy pickle file, on CPU; ``PermissionError`` unless trusted.

    Even when trusted, torch's restricted ``weights_only`` unpickler (tensors, containers and
    primitives; it runs no code) is tried first; full unpickling happens only for files that
    hold other objects (a Lightning ``.ckpt``'s hyperparameters, DeepSpeed's client state).
    """
    require_trust(os.fspath(path), trust_pickle=trust_pickle)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, map_location="cpu", weights_only=False)


__all__ = ["load_trusted_pickle", "require_trust"]
