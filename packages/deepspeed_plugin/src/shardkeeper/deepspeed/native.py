"""Import a native DeepSpeed checkpoint directory (``<dir>/global_step<N>/...``, what
``engine.save_checkpoint`` writes without shardkeeper) into the shardkeeper format.

DeepSpeed's files are pickles: reading them can run code, so the import refuses, before it
reads anything, unless the caller passes ``trust_pickle=True``, the bool (the core's
``require_trust``), and warns even then. It uses DeepSpeed's own offline
converter (``deepspeed.checkpoint.ds_to_universal``) to turn the ZeRO partitions into
per-parameter fp32 weights and optimizer state, then saves them under the canonical keys in
one process, so the result restores into any engine, stage and world size, or plain torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from shardkeeper.core import normalize_fqn
from shardkeeper.core.adapter import RootManagers, load_trusted_pickle, progress_state, require_trust
from shardkeeper.deepspeed._ds_internals import SCALER_FIELDS
from shardkeeper.deepspeed.hook import tag_to_step
from shardkeeper.deepspeed.state import FRAMEWORK

#: Keys of DeepSpeed's model-states file that are DeepSpeed's own (the rest is client state).
_DS_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "universal_checkpoint_info",
}


def _load(path: Path, trust_pickle: bool) -> Any:
    return load_trusted_pickle(path, trust_pickle=trust_pickle)


def _jsonable(key: str, v: Any, dropped: list[str]) -> Any:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(f"{key}/{k}", x, dropped) for k, x in v.items()}
    try:
        json.dumps(v)  # NaN and infinities are kept (the manifest stores them exactly)
        return v
    except (TypeError, ValueError):
        dropped.append(key)
        return None


def _find_step(obj: Any) -> Any:
    """The first per-parameter ``step`` in a (nested) torch optimizer state dict, if any."""
    if isinstance(obj, dict):
        st = obj.get("state")
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, dict) and "step" in v:
                    return v["step"]
        for v in obj.values():
            found = _find_step(v)
            if found is not None:
                return found
    return None


def _zero3_frozen(ckpt_dir: Path, name: str, numel: int, trust_pickle: bool) -> torch.Tensor | None:
    """A frozen ZeRO-3 parameter from every rank's ``frozen_param_fragments``, in rank order."""

    def rank_of(f: Path) -> int:
        m = re.search(r"zero_pp_rank_(\d+)_", f.name)
        return int(m.group(1)) if m else 0

    files = sorted(ckpt_dir.glob("zero_pp_rank_*_model_states.pt"), key=rank_of)
    parts = []
    for f in files:
        frag = (_load(f, trust_pickle).get("frozen_param_fragments") or {}).get(name)
        if frag is None:
            return None
        parts.append(frag.reshape(-1))
    if not parts:
        return None
    flat = torch.cat(parts)
    return flat[:numel] if flat.numel() >= numel else None


def _to_universal(ckpt_dir: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(ckpt_dir),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)


def import_native_checkpoint(
    src: str | Path,
    root: str,
    tag: str | None = None,
    *,
    trust_pickle: bool = False,
    step: int | None = None,
    universal_dir: str | Path | None = None,
    **manager_options: Any,
) -> int:
    """Convert ``src/<tag>`` (default: the tag in ``src/latest``) into a committed step under
    ``root``; returns the step (the tag's number, else the checkpoint's global_steps).

    ``universal_dir`` keeps DeepSpeed's intermediate universal checkpoint there (by default a
    temporary directory, removed). Run it in one process.
    """
    src = Path(src)
    # Before anything is read: DeepSpeed's converter unpickles every file it opens.
    require_trust(src, trust_pickle=trust_pickle, why="it is a native DeepSpeed checkpoint, whose files are pickles")
    if tag is None:
        latest = src / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"no 'latest' file in {src}; pass tag='global_step<N>'")
        tag = latest.read_text().strip()
    ckpt_dir = src / str(tag)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint at {ckpt_dir}")
    warnings.warn(f"unpickling the native DeepSpeed checkpoint {ckpt_dir} (trust_pickle=True)", stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="sk-ds-universal-") as tmp:
        out = Path(universal_dir) if universal_dir is not None else Path(tmp) / "universal"
        _to_universal(ckpt_dir, out)
        state, ds_step = _read_universal(out, ckpt_dir, trust_pickle)
    if step is None:
        step = tag_to_step(tag)
    if step is None:
        step = ds_step
    import deepspeed

    managers = RootManagers(FRAMEWORK, deepspeed.__version__, manager_options, imported_from=str(ckpt_dir))
    try:
        managers.get(root).save(step, state, async_save=False, metadata={"tag": str(tag)})
    finally:
        managers.close()
    return step


def _read_universal(out: Path, ckpt_dir: Path, trust_pickle: bool) -> tuple[dict[str, Any], int]:
    """The state to save of DeepSpeed's universal checkpoint ``out`` (converted from
    ``ckpt_dir``), and the checkpoint's global step."""
    model_files = sorted(out.glob("*model_states.pt")) or sorted(ckpt_dir.glob("*model_states.pt"))
    if not model_files:
        raise FileNotFoundError(f"no *model_states.pt in {ckpt_dir}")
    ms = _load(model_files[0], trust_pickle)
    zero = out / "zero"
    opt_file = zero / "optimizer_state.pt"
    opt_sd = _load(opt_file, trust_pickle) if opt_file.is_file() else {}
    model, optim_state, group_fqns = _trained_params(ms, zero, _find_step(opt_sd), trust_pickle)
    module = ms.get("module") or {}
    _add_frozen(model, ms, module, zero, ckpt_dir, trust_pickle)
    for name in ms.get("buffer_names") or []:
        if name in module:  # fp32, as engine_state stores buffers DeepSpeed cast down
            buf = module[name]
            model[normalize_fqn(name)] = buf.float() if buf.dtype in (torch.bfloat16, torch.float16) else buf
    param_groups = []
    if opt_sd:
        saved_groups = opt_sd.get("param_groups", [])
        for g, fqns in zip(saved_groups, group_fqns):
            param_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
    client = _client_state(ms)
    ds_step = int(ms.get("global_steps", 0))
    state: dict[str, Any] = {
        "model": model,
        "optim": {"state": optim_state, "param_groups": param_groups},
        "progress": _progress(ms, opt_sd, ds_step),
        "extra": {"client_state": client},
    }
    if ms.get("lr_scheduler") is not None:
        state["sched"] = _jsonable("lr_scheduler", ms["lr_scheduler"], [])
    return state, ds_step


def _trained_params(
    ms: dict[str, Any], zero: Path, fallback_step: Any, trust_pickle: bool
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[list[str]]]:
    """The trained parameters' fp32 weights and optimizer state (by canonical name) from the
    converter's per-parameter files under ``zero``, and each parameter group's names.
    ``fallback_step``: the optimizer's step, for ZeRO-3, whose conversion writes none per
    parameter."""
    groups_shapes = ms.get("param_shapes") or []
    if isinstance(groups_shapes, dict):
        groups_shapes = [groups_shapes]
    model: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    group_fqns: list[list[str]] = []
    for shapes in groups_shapes:
        fqns = []
        for name, shape in shapes.items():
            fqn = normalize_fqn(name)
            fqns.append(fqn)
            shape = tuple(int(s) for s in shape)
            per: dict[str, Any] = {}
            for f in sorted((zero / name).glob("*.pt")):
                v = _load(f, trust_pickle)
                v = v["param"] if isinstance(v, dict) and "param" in v else v
                if f.stem == "fp32":
                    model[fqn] = v.float().reshape(shape).contiguous()
                elif isinstance(v, torch.Tensor) and v.numel() == math.prod(shape):
                    per[f.stem] = v.float().reshape(shape).contiguous()
                else:  # scalar state: step, kept as torch keeps it (a float32 tensor)
                    per[f.stem] = torch.tensor(float(v), dtype=torch.float32)
            if "step" not in per and fallback_step is not None:
                per["step"] = torch.tensor(float(fallback_step), dtype=torch.float32)
            if fqn not in model:
                raise FileNotFoundError(f"DeepSpeed's converter wrote no fp32 weights for {name} under {zero}")
            optim_state[fqn] = per
        group_fqns.append(fqns)
    return model, optim_state, group_fqns


def _add_frozen(
    model: dict[str, Any], ms: dict[str, Any], module: dict[str, Any], zero: Path, ckpt_dir: Path, trust_pickle: bool
) -> None:
    """Add the frozen parameters to ``model``, as fp32 like buffers. They have no fp32 master:
    DeepSpeed's converter writes their module value (ZeRO-1/2) when it has one; else the
    module state has it. One found nowhere is warned about and left out."""
    for name, shape in (ms.get("frozen_param_shapes") or {}).items():
        fqn = normalize_fqn(name)
        f = zero / name / "fp32.pt"
        value: Any = _load(f, trust_pickle) if f.is_file() else module.get(name)
        value = value["param"] if isinstance(value, dict) and "param" in value else value
        if not isinstance(value, torch.Tensor) or value.numel() != math.prod(tuple(shape)):
            value = _zero3_frozen(ckpt_dir, name, math.prod(tuple(shape)), trust_pickle)
        if isinstance(value, torch.Tensor) and value.numel() == math.prod(tuple(shape)):
            model[fqn] = value.float().reshape(tuple(shape)).contiguous()
        else:
            warnings.warn(f"frozen parameter {name} is not in {ckpt_dir}; it is not imported", stacklevel=4)


def _client_state(ms: dict[str, Any]) -> dict[str, Any]:
    """The entries of the model-states file that are not DeepSpeed's own, as JSON or tensors;
    the others are warned about and left out."""
    dropped: list[str] = []
    client = {
        k: _jsonable(k, v, dropped)
        for k, v in ms.items()
        if k not in _DS_KEYS and not k.endswith(("_degree", "_world_size"))
    }
    if dropped:
        warnings.warn(
            f"client state entries that are neither tensors nor JSON were not imported: {dropped}", stacklevel=4
        )
    return client


def _progress(ms: dict[str, Any], opt_sd: Any, ds_step: int) -> dict[str, Any]:
    """The training progress at ``ds_step``, with DeepSpeed's counters and its loss scaler's
    fields."""
    gas = (
        int((ms.get("ds_config") or {}).get("gradient_accumulation_steps", 1) or 1)
        if isinstance(ms.get("ds_config"), dict)
        else 1
    )
    scaler: dict[str, Any] = {}
    if opt_sd:
        ls = opt_sd.get("loss_scaler")
        for name in SCALER_FIELDS:
            if hasattr(ls, name):
                v = getattr(ls, name)
                scaler[name] = float(v) if isinstance(v, (float, torch.Tensor)) else v
    return progress_state(
        step=ds_step,
        samples=int(ms.get("global_samples", 0)),
        counters={
            FRAMEWORK: {
                "global_step": ds_step,
                "global_samples": int(ms.get("global_samples", 0)),
                "skipped_steps": int(ms.get("skipped_steps", 0)),
                "micro_steps": ds_step * gas,
                "loss_scaler": scaler,
            }
        },
    )


__all__ = ["import_native_checkpoint"]
