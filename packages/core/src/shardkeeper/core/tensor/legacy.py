"""The one place shardkeeper unpickles: legacy checkpoints, on the caller's explicit trust.

shardkeeper's own format holds no pickle and restore never unpickles. Importers of checkpoints
written by other tools (a Lightning ``.ckpt``, DeepSpeed's ``global_step*/`` files) must read
those pickles once to convert them; they do it only through this function, which refuses
unless the caller passed ``trust_pickle=True``, so the opt-in cannot be skipped by a code path.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def load_trusted_pickle(path: str | os.PathLike[str], *, trust_pickle: bool) -> Any:
    """``torch.load`` of a legacy pickle file, on CPU; ``PermissionError`` unless trusted."""
    if trust_pickle is not True:
        raise PermissionError(
            f"{os.fspath(path)} is a pickle, which can run code when loaded; shardkeeper reads it "
            f"only when you pass trust_pickle=True for files you trust"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


__all__ = ["load_trusted_pickle"]
