"""Import of an existing Lightning checkpoint (a ``.ckpt`` file) into the shardkeeper format.

A ``.ckpt`` is a pickle: loading one can run arbitrary code. This is the one place the
Lightning adapter reads a pickle, only with ``trust_pickle=True``, and it warns even then.
The imported step holds the same canonical entries the plugin writes, so
``fit(ckpt_path=plugin.step_path(step))`` resumes from it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.lightning import codec


def import_lightning_checkpoint(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    module: torch.nn.Module | None = None,
    trust_pickle: bool = False,
    **manager_options: Any,
) -> int:
    """Write the Lightning ``.ckpt`` at ``path`` as a committed step under ``root``; return the
    step (the checkpoint's ``global_step``). Run it in one process.

    ``module``: the LightningModule (built as for training, not yet trained); needed to store
    the optimizer states, whose parameters a ``.ckpt`` names by position only: they are mapped
    to FQNs by loading them into the optimizers of ``module.configure_optimizers()``. Without
    it the import keeps everything but the optimizer states (with a warning).
    """
    src = os.fspath(path)
    if os.path.isdir(src):
        raise NotImplementedError(
            f"{src} is a directory (a sharded Lightning/DCP checkpoint or a DeepSpeed one); only "
            f"single-file .ckpt checkpoints are imported in this version"
        )
    if not trust_pickle:
        raise PermissionError(
            f"{src} is a pickle (a Lightning .ckpt): loading it can run arbitrary code. If you "
            f"trust its origin, call import_lightning_checkpoint({src!r}, {os.fspath(root)!r}, "
            f"trust_pickle=True)"
        )
    warnings.warn(f"unpickling {src} (trust_pickle=True): only do this for files you trust", stacklevel=2)
    ck = torch.load(src, map_location="cpu", weights_only=False)
    if not isinstance(ck, dict) or "state_dict" not in ck:
        raise ValueError(f"{src} is not a Lightning checkpoint (no 'state_dict' entry)")
    step = int(ck.get("global_step", 0))
    state: dict[str, Any] = {"model": {k: v for k, v in ck["state_dict"].items()}}
    n_opt = 0
    osds = list(ck.get("optimizer_states") or [])
    if osds and module is None:
        warnings.warn(
            f"{src}: its optimizer states are not imported (pass module=<the LightningModule> to "
            f"map their parameters to names); a resume from the imported step needs them",
            stacklevel=2,
        )
    elif osds and module is not None:
        state["model"] = module
        module.load_state_dict(ck["state_dict"])
        opts = _optimizers(module, src)
        if len(opts) != len(osds):
            raise ValueError(
                f"{src} holds {len(osds)} optimizer state(s), {type(module).__name__}."
                f"configure_optimizers() returns {len(opts)}: give the module as it was trained"
            )
        for opt, osd in zip(opts, osds, strict=True):
            opt.load_state_dict(osd)
        n_opt = len(opts)
        state["optim"] = opts[0] if n_opt == 1 else {str(i): o for i, o in enumerate(opts)}
    scheds = list(ck.get("lr_schedulers") or []) if n_opt else []
    if scheds:
        enc = [codec.encode(s, f"lr_schedulers/{i}") for i, s in enumerate(scheds)]
        state["sched"] = enc[0] if len(enc) == 1 else {str(i): s for i, s in enumerate(enc)}
    progress: dict[str, Any] = {"global_step": step, "epoch": int(ck.get("epoch", 0))}
    if "loops" in ck:
        progress["loops"] = codec.encode(ck["loops"], "loops")
    state["progress"] = progress
    extra: dict[str, Any] = {"lightning": {
        "version": str(ck.get("pytorch-lightning_version", "")), "weights_only": not n_opt,
        "optimizers": n_opt, "schedulers": len(scheds), "strategy": "imported", "imported_from": src,
    }}
    if "callbacks" in ck:
        extra["callbacks"] = codec.encode(ck["callbacks"], "callbacks")
    rest = codec.encode_rest(ck, where=str(src), stacklevel=2)
    if rest:
        extra["checkpoint"] = rest
    state["extra"] = extra
    meta = dict(manager_options.pop("metadata", None) or {})
    meta.setdefault("framework_adapter", "lightning")
    meta.setdefault("imported_from", src)
    with CheckpointManager(root, metadata=meta, **manager_options) as mgr:
        mgr.save(step, state, async_save=False)
    return step


def _optimizers(module: Any, src: str) -> list[torch.optim.Optimizer]:
    from lightning.pytorch.core.optimizer import _configure_optimizers

    try:  # as the Trainer parses configure_optimizers(), without a Trainer
        opts, _, _ = _configure_optimizers(module.configure_optimizers())
    except Exception as e:
        raise RuntimeError(
            f"importing {src}: {type(module).__name__}.configure_optimizers() failed outside a "
            f"Trainer ({type(e).__name__}: {e}); import without module= (weights and loop state only)"
        ) from e
    return list(opts)


__all__ = ["import_lightning_checkpoint"]
