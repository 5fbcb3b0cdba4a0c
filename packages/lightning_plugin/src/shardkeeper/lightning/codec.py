"""Lightning's non-model state <-> values the core stores (tensors and JSON), and back.

Lightning checkpoints hold loop progress, callback states, scheduler states and user extras:
nested dicts of numbers, strings, tensors, sometimes tuples, non-finite floats (an
``EarlyStopping`` best score starts at ``inf``) and keys with ``/`` in them. The core stores
tensors and JSON values and joins nested keys with ``/``, so :func:`encode` makes such a value
storable and :func:`decode` (applied to the tree :func:`skeleton` rebuilt from a manifest and
the core filled) gives it back:

- dict keys: ``%`` ``/`` ``#`` are percent-escaped, a leading ``__`` is escaped, int keys are
  written ``#i:<n>``;
- a list or tuple holding a tensor becomes ``{"__seq__": "list"|"tuple", "0": ..., ...}``
  (the core splits it by index; this records that it was a sequence);
- ``inf``/``-inf``/``nan`` become ``{"__float__": "inf"}``;
- numpy scalars become Python numbers; anything else that is not JSON raises ``TypeError``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

_SEQ = "__seq__"
_FLOAT = "__float__"


def _esc(key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"dict key {key!r} ({type(key).__name__}) is neither str nor int")
    if isinstance(key, int):
        return f"#i:{key}"
    s = key.replace("%", "%25").replace("/", "%2F").replace("#", "%23")
    if s.startswith("__"):
        s = "%5F" + s[1:]
    return s


def _unesc(key: str) -> Any:
    if key.startswith("#i:"):
        return int(key[3:])
    if key.startswith("%5F"):
        key = "_" + key[3:]
    return key.replace("%23", "#").replace("%2F", "/").replace("%25", "%")


def _has_tensor(x: Any) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(x, Mapping):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def encode(x: Any, where: str = "") -> Any:
    """A storable copy of ``x`` (tensors are kept by reference: the core stages them)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {_FLOAT: repr(x)}
    if isinstance(x, Mapping):
        return {_esc(k): encode(v, f"{where}/{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if _has_tensor(x):
            out: dict[str, Any] = {_SEQ: "tuple" if isinstance(x, tuple) else "list"}
            out.update({str(i): encode(v, f"{where}/{i}") for i, v in enumerate(x)})
            return out
        return [encode(v, f"{where}/{i}") for i, v in enumerate(x)]
    raise TypeError(
        f"{where or 'value'} is a {type(x).__name__}, which shardkeeper cannot store without "
        f"pickling; store tensors, numbers, strings, lists and dicts instead"
    )


def decode(x: Any) -> Any:
    if isinstance(x, Mapping):
        if _FLOAT in x and len(x) == 1:
            return float(x[_FLOAT])
        if _SEQ in x:
            kind = x[_SEQ]
            items = [decode(x[k]) for k in sorted((k for k in x if k != _SEQ), key=int)]
            return tuple(items) if kind == "tuple" else items
        return {_unesc(k): decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


def skeleton(leaves: Mapping[str, Any], prefix: str) -> Any:
    """The restore target for every leaf under ``prefix`` of a manifest's ``leaves``.

    Object leaves carry their saved value already; tensor leaves get an empty tensor of the
    saved shape and dtype for the core to fill. Returns ``None`` when nothing is there.
    """
    root: dict[str, Any] = {}
    found = False
    head = prefix + "/"
    for key in leaves:
        if key != prefix and not key.startswith(head):
            continue
        rec = leaves[key]
        value = _placeholder(rec)
        found = True
        if key == prefix:
            return value
        parts = key[len(head) :].split("/")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return root if found else None


def _placeholder(rec: Any) -> Any:
    if rec.kind == "object":
        return rec.value
    if rec.kind == "bytes":
        return b""
    return torch.empty(tuple(rec.shape), dtype=getattr(torch, rec.dtype))


#: Keys of Lightning's checkpoint dict that map onto canonical namespaces (the rest of the
#: dict goes to ``extra/checkpoint``).
MAPPED = frozenset(
    {
        "epoch",
        "global_step",
        "pytorch-lightning_version",
        "state_dict",
        "loops",
        "callbacks",
        "optimizer_states",
        "lr_schedulers",
    }
)
#: Hyperparameter entries: stored when they are JSON-like, skipped with a warning otherwise.
BEST_EFFORT = frozenset(
    {
        "hyper_parameters",
        "hparams_name",
        "hparams_type",
        "datamodule_hyper_parameters",
        "datamodule_hparams_name",
        "datamodule_hparams_type",
    }
)


def encode_rest(ck: Mapping[str, Any], *, skip: Iterable[str] = (), where: str, stacklevel: int) -> dict[str, Any]:
    """The entries of a Lightning checkpoint dict that no canonical namespace takes, encoded.

    Hyperparameters that cannot be stored are skipped with a warning; anything else that
    cannot be stored is an error naming ``where`` and the entry.
    """
    skipped = MAPPED | set(skip)
    rest: dict[str, Any] = {}
    for k, v in ck.items():
        if k in skipped:
            continue
        try:
            rest[k] = encode(v, k)
        except TypeError as e:
            if k not in BEST_EFFORT:
                raise TypeError(f"{where}: entry {k!r} cannot be stored by shardkeeper: {e}") from None
            warnings.warn(f"{where}: entry {k!r} is not stored: {e}", stacklevel=stacklevel + 1)
    return rest


__all__ = ["BEST_EFFORT", "MAPPED", "decode", "encode", "encode_rest", "skeleton"]
