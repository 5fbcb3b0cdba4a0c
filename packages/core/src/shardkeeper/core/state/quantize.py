"""Quantized optimizer state: LOSSY, off by default. Adam's moments stored in bf16, or as
blockwise 8-bit codes with fp32 scales, and restored to the optimizer's own dtype.

Put the wrapper in the state instead of the optimizer::

    from shardkeeper.core.state.quantize import quantized
    state = {"model": model, "optim": quantized(opt, model, mode="int8")}
    mgr.save(step, state); mgr.restore(state)

It works at the state level, without a format change: its ``state_dict()`` holds the
moments as ordinary tensor leaves (``optim/state/<fqn>/exp_avg`` in bf16, or
``.../exp_avg/q`` int8 codes + ``.../exp_avg/scale`` fp32 absmax per block); everything else
(steps, other state, param groups) is stored exactly. The manifest's metadata says
``quantized: {"optim": {...}}``; restoring such a checkpoint into a plain optimizer entry is
refused with an error naming the remedy.

int8 blocks run along the last dimension (``block`` elements; the last block of a row may
be shorter), so a row holds whole blocks and the scales have the moment's shape with the
last dimension replaced by the block count: a moment sharded by rows (FSDP, FSDP2, ZeRO-like
``Shard(0)``, column-wise tensor parallel) keeps its blocks whole, and the codes and scales
reshard on restore exactly like the moment. ``exp_avg_sq`` is quantized as its square root
(half the dynamic range; Adam uses the root anyway). Only floating moments with two or more
dimensions are quantized; 0-d and 1-d state (steps, biases) stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.flatten import normalize_fqn
from shardkeeper.core.state.optim_compat import METADATA_KEY, optimizer_classes

MODES = ("bf16", "int8")
DEFAULT_NAMES = ("exp_avg", "exp_avg_sq")
_ROOT = {"exp_avg_sq"}  # stored as sqrt: non-negative, huge dynamic range


def _quantizable(name: str, t: Any, names: Sequence[str]) -> bool:
    return name in names and isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if tc.is_dtensor(t) else t


def _like(t: torch.Tensor, local: torch.Tensor, last: int) -> torch.Tensor:
    """``local`` as a tensor laid out like ``t`` with its last global dimension ``last``."""
    if not tc.is_dtensor(t):
        return local
    from torch.distributed.tensor import DTensor

    shape = (*t.shape[:-1], last)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _check_layout(t: torch.Tensor, where: str) -> None:
    if tc.is_dtensor(t):
        for p in t.placements:
            if tc.is_shard_placement(p) and p.dim in (-1, t.dim() - 1):  # type: ignore[attr-defined]
                raise NotImplementedError(
                    f"{where}: the moment is sharded along its last dimension (e.g. row-wise tensor "
                    f"parallel); int8 blocks run along it, so this layout is not supported: use "
                    f"mode='bf16' or shard the parameter by rows"
                )


def quantize_int8(x: torch.Tensor, block: int, root: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain tensor -> (int8 codes, fp32 absmax scales per ``block`` of the last dimension)."""
    v = x.detach().float()
    if root:
        v = v.clamp_min(0).sqrt()
    n = v.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    vp = torch.nn.functional.pad(v, (0, pad)) if pad else v
    blocks = vp.reshape(*v.shape[:-1], nb, block)
    scale = blocks.abs().amax(dim=-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe.unsqueeze(-1) * 127.0).clamp_(-127, 127).to(torch.int8)
    q = q.reshape(*v.shape[:-1], nb * block)[..., :n].contiguous()
    return q, scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block: int, root: bool, dtype: torch.dtype) -> torch.Tensor:
    n = q.shape[-1]
    nb = scale.shape[-1]
    pad = nb * block - n
    qp = torch.nn.functional.pad(q.float(), (0, pad)) if pad else q.float()
    v = qp.reshape(*q.shape[:-1], nb, block) * (scale.unsqueeze(-1) / 127.0)
    v = v.reshape(*q.shape[:-1], nb * block)[..., :n]
    if root:
        v = v * v
    return v.to(dtype)


class QuantizedOptimizer:
    """A stateful wrapper of ``optimizer`` (whose parameters ``model`` owns) for the state:
    the moments go through bf16 or int8 on save and come back in their own dtype."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        mode: str = "bf16",
        block: int = 64,
        names: Sequence[str] = DEFAULT_NAMES,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; choose one of {', '.join(MODES)}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.optimizer, self.model, self.mode, self.block, self.names = optimizer, model, mode, block, tuple(names)

    def describe(self) -> dict[str, Any]:
        """What the manifest's metadata records (``metadata.quantized.<key>``)."""
        return {
            "mode": self.mode,
            "block": self.block,
            "names": list(self.names),
            "lossy": True,
            "sqrt": sorted(_ROOT & set(self.names)),
        }

    def _osd(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return dict(get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions()))

    def state_dict(self) -> dict[str, Any]:
        osd = self._osd()
        self._last = osd
        state: dict[str, Any] = {}
        for fqn, per in osd.get("state", {}).items():
            nfqn = normalize_fqn(str(fqn))
            out: dict[str, Any] = {}
            for name, t in per.items():
                if not _quantizable(name, t, self.names):
                    out[name] = t
                elif self.mode == "bf16":
                    out[name] = t.detach().to(torch.bfloat16)
                else:
                    _check_layout(t, f"optimizer state {nfqn}/{name}")
                    q, s = quantize_int8(_local(t), self.block, name in _ROOT)
                    out[name] = {"q": _like(t, q, t.shape[-1]), "scale": _like(t, s, s.shape[-1])}
            state[nfqn] = out
        groups = [
            {**g, "params": [normalize_fqn(str(p)) for p in g.get("params", [])]} for g in osd.get("param_groups", [])
        ]
        return {"quantization": self.describe(), "state": state, "param_groups": groups}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        info = sd.get("quantization") or {}
        if info.get("mode", self.mode) != self.mode or int(info.get("block", self.block)) != self.block:
            raise StateMismatchError(
                f"the checkpoint's optimizer state is quantized as {info}; this wrapper is "
                f"mode={self.mode!r}, block={self.block}: build it with the checkpoint's settings"
            )
        osd = self._osd()
        by_norm = {normalize_fqn(str(f)): f for f in osd.get("state", {})}
        with torch.no_grad():
            for nfqn, per in sd["state"].items():
                fqn = by_norm.get(nfqn)
                if fqn is None:
                    raise StateMismatchError(
                        f"quantized optimizer state names {nfqn!r}, which the optimizer does not hold"
                    )
                target = osd["state"][fqn]
                for name, saved in per.items():
                    cur = target[name]
                    if isinstance(saved, Mapping):
                        vals = dequantize_int8(
                            _local(saved["q"]), _local(saved["scale"]), self.block, name in _ROOT, cur.dtype
                        )
                        _local(cur).copy_(vals)
                    elif isinstance(cur, torch.Tensor) and isinstance(saved, torch.Tensor):
                        if cur is not saved:
                            cur.copy_(saved.to(cur.dtype))
                    else:
                        target[name] = saved
        by_norm_p = {normalize_fqn(str(p)): p for g in osd.get("param_groups", []) for p in g.get("params", [])}
        groups = [
            {**g, "params": [by_norm_p.get(p, p) for p in g.get("params", [])]} for g in sd.get("param_groups", [])
        ]
        if len(groups) == len(osd.get("param_groups", [])):
            osd["param_groups"] = [{**t, **g} for t, g in zip(osd["param_groups"], groups, strict=True)]
        set_optimizer_state_dict(self.model, self.optimizer, osd, options=StateDictOptions())


def quantized(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    *,
    mode: str = "bf16",
    block: int = 64,
    names: Sequence[str] = DEFAULT_NAMES,
) -> QuantizedOptimizer:
    """Wrap ``optimizer`` so that its moments are saved quantized (LOSSY; see the module doc)."""
    return QuantizedOptimizer(optimizer, model, mode=mode, block=block, names=names)


def state_metadata(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the manifest's metadata records about ``state``: ``{"quantized": {key: ...}}`` for
    the wrappers at its top, ``{"optimizer_classes": {key: class}}`` for its optimizers (restore
    refuses another kind of optimizer, state/optim_compat.py)."""
    out: dict[str, Any] = {}
    q = {str(k): v.describe() for k, v in state.items() if isinstance(v, QuantizedOptimizer)}
    if q:
        out["quantized"] = q
    classes = optimizer_classes(state)
    if classes:
        out[METADATA_KEY] = classes
    return out


def check_restore_target(metadata: Mapping[str, Any], state: Mapping[str, Any], where: str) -> None:
    """Refuse to restore a quantized optimizer entry into a plain optimizer."""
    q = metadata.get("quantized")
    if not isinstance(q, Mapping):
        return
    for key, info in q.items():
        if isinstance(state.get(key), torch.optim.Optimizer):
            raise StateMismatchError(
                f"{where}: the optimizer state under {key!r} was saved quantized ({info}); restore it "
                f"through the same wrapper: state[{key!r}] = quantized(optimizer, model, "
                f"mode={info.get('mode')!r}, block={info.get('block')})"
            )


__all__ = [
    "MODES",
    "QuantizedOptimizer",
    "check_restore_target",
    "dequantize_int8",
    "quantize_int8",
    "quantized",
    "state_metadata",
]
