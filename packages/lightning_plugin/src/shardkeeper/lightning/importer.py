"""Import of an existing Lightning checkpoint (a ``.ckpt`` file or a sharded DCP directory)
into the shardkeeper format.

A ``.ckpt`` is a pickle, and so are a sharded directory's ``.metadata`` and ``meta.pt``:
loading one can run arbitrary code. This is the one place the
Lightning adapter reads pickles, only with ``trust_pickle=True``, the bool (the core's
``require_trust``, before anything is read), and it warns even then.
The imported step holds the same canonical entries the plugin writes, so
``fit(ckpt_path=plugin.step_path(step))`` resumes from it.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch

from shardkeeper.core import normalize_fqn
from shardkeeper.core.adapter import RootManagers, load_dcp, load_trusted_pickle, progress_state, require_trust
from shardkeeper.lightning import _internals as li
from shardkeeper.lightning import codec
from shardkeeper.lightning.binding import FRAMEWORK


def import_lightning_checkpoint(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    module: torch.nn.Module | None = None,
    trust_pickle: bool = False,
    **manager_options: Any,
) -> int:
    """Write the Lightning checkpoint at ``path`` as a committed step under ``root``; return the
    step (the checkpoint's ``global_step``). Run it in one process.

    ``path`` is a ``.ckpt`` file or a sharded directory (``FSDPStrategy(state_dict_type=
    "sharded")`` / ``ModelParallelStrategy``: DCP files plus ``meta.pt``). Both are pickles
    (the DCP ``.metadata`` and ``meta.pt``): refused without ``trust_pickle=True``.

    ``module``: for a ``.ckpt`` only, the LightningModule (built as for training, not yet
    trained); needed to store the optimizer states, whose parameters a ``.ckpt`` names by
    position only: they are mapped to FQNs by loading them into the optimizers of
    ``module.configure_optimizers()``. Without it the import keeps everything but the optimizer
    states (with a warning). A sharded directory names them by FQN already; ``module`` is unused.
    """
    src = os.fspath(path)
    sharded = os.path.isdir(src)
    require_trust(
        src,
        trust_pickle=trust_pickle,
        why=(
            "it is a sharded Lightning checkpoint, whose DCP .metadata and meta.pt are pickles"
            if sharded
            else "it is a Lightning .ckpt, which is a pickle"
        ),
    )
    if sharded and not os.path.isfile(os.path.join(src, ".metadata")):
        raise NotImplementedError(
            f"{src} is a directory without a DCP .metadata file (a DeepSpeed checkpoint?); only "
            f".ckpt files and sharded Lightning directories (FSDPStrategy sharded, "
            f"ModelParallelStrategy) are imported in this version"
        )
    if sharded:
        ck, model_entry, optims = _read_sharded(src, trust_pickle)
    else:
        ck, model_entry, optims = _read_ckpt(src, module, trust_pickle)
    step = int(ck.get("global_step", 0))
    state: dict[str, Any] = {"model": model_entry}
    n_opt = len(optims)
    if n_opt:
        state["optim"] = optims[0] if n_opt == 1 else {str(i): o for i, o in enumerate(optims)}
    scheds = list(ck.get("lr_schedulers") or []) if n_opt else []
    if scheds:
        enc = [codec.encode(s, f"lr_schedulers/{i}") for i, s in enumerate(scheds)]
        state["sched"] = enc[0] if len(enc) == 1 else {str(i): s for i, s in enumerate(enc)}
    ours = {"loops": codec.encode(ck["loops"], "loops")} if "loops" in ck else {}
    state["progress"] = progress_state(step=step, epoch=int(ck.get("epoch", 0)), counters={FRAMEWORK: ours})
    extra: dict[str, Any] = {
        "lightning": {
            "version": str(ck.get("pytorch-lightning_version", "")),
            "weights_only": not n_opt,
            "optimizers": n_opt,
            "schedulers": len(scheds),
            "strategy": "imported",
            "imported_from": src,
        }
    }
    if "callbacks" in ck:
        extra["callbacks"] = codec.encode(ck["callbacks"], "callbacks")
    rest = codec.encode_rest(ck, where=str(src), stacklevel=2)
    if rest:
        extra["checkpoint"] = rest
    state["extra"] = extra
    import lightning

    managers = RootManagers(FRAMEWORK, lightning.__version__, manager_options, imported_from=str(src))
    try:
        managers.get(root).save(step, state, async_save=False)
    finally:
        managers.close()
    return step


def _read_ckpt(src: str, module: torch.nn.Module | None, trust_pickle: bool) -> tuple[dict[str, Any], Any, list[Any]]:
    """A ``.ckpt``: its dict, the model entry and the optimizers (through ``module``)."""
    warnings.warn(f"unpickling {src} (trust_pickle=True): only do this for files you trust", stacklevel=3)
    ck = load_trusted_pickle(src, trust_pickle=trust_pickle)
    if not isinstance(ck, dict) or "state_dict" not in ck:
        raise ValueError(f"{src} is not a Lightning checkpoint (no 'state_dict' entry)")
    osds = list(ck.get("optimizer_states") or [])
    if osds and module is None:
        warnings.warn(
            f"{src}: its optimizer states are not imported (pass module=<the LightningModule> to "
            f"map their parameters to names); a resume from the imported step needs them",
            stacklevel=3,
        )
    if not osds or module is None:
        return ck, dict(ck["state_dict"].items()), []
    module.load_state_dict(ck["state_dict"])
    opts = _optimizers(module, src)
    if len(opts) != len(osds):
        raise ValueError(
            f"{src} holds {len(osds)} optimizer state(s), {type(module).__name__}."
            f"configure_optimizers() returns {len(opts)}: give the module as it was trained"
        )
    for opt, osd in zip(opts, osds, strict=True):
        opt.load_state_dict(osd)
    return ck, module, list(opts)


def _read_sharded(src: str, trust_pickle: bool) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A sharded directory, read whole in this process (DCP without a process group): the
    ``meta.pt`` dict, the model entry and the optimizer entries, keyed by normalized FQN as the
    core keys a module and an optimizer (``<fqn>``; ``state/<fqn>/<name>``, ``param_groups``)."""
    meta_path = os.path.join(src, "meta.pt")
    if not os.path.isfile(meta_path):
        raise ValueError(
            f"{src}: no meta.pt (the trainer state Lightning writes beside the DCP files); not a Lightning sharded checkpoint"
        )
    warnings.warn(
        f"unpickling {src}/.metadata and {meta_path} (trust_pickle=True): only do this for files you trust",
        stacklevel=3,
    )
    ck = load_trusted_pickle(meta_path, trust_pickle=trust_pickle)
    if not isinstance(ck, dict):
        raise ValueError(f"{meta_path} holds a {type(ck).__name__}, not Lightning's checkpoint dict")
    sd = load_dcp(src, trust_pickle=trust_pickle)  # core's DCP reader, behind the same opt-in
    key = "state_dict" if "state_dict" in sd else "model"  # ModelParallelStrategy / FSDPStrategy
    if key not in sd:
        raise ValueError(
            f"{src}: the DCP checkpoint has no 'state_dict' or 'model' entry (it holds {sorted(sd)}); not written by Lightning"
        )
    model = {normalize_fqn(str(k)): v for k, v in sd[key].items()}
    optims = []
    for i in range(sum(1 for k in sd if re.fullmatch(r"optimizer_\d+", k))):
        osd = sd.get(f"optimizer_{i}")
        if not isinstance(osd, dict) or "state" not in osd:
            raise ValueError(f"{src}: DCP entry optimizer_{i} is missing or not an optimizer state dict")
        optims.append(
            {
                "state": {normalize_fqn(str(f)): dict(st) for f, st in osd["state"].items()},
                "param_groups": [
                    {**g, "params": [normalize_fqn(str(p)) for p in g.get("params", [])]}
                    for g in osd.get("param_groups", [])
                ],
            }
        )
    return ck, model, optims


def _optimizers(module: Any, src: str) -> list[torch.optim.Optimizer]:
    try:  # as the Trainer parses configure_optimizers(), without a Trainer
        return li.parse_optimizers(module.configure_optimizers())
    except li.LightningInternalsError:
        raise
    except Exception as e:
        raise RuntimeError(
            f"importing {src}: {type(module).__name__}.configure_optimizers() failed outside a "
            f"Trainer ({type(e).__name__}: {e}); import without module= (weights and loop state only)"
        ) from e


__all__ = ["import_lightning_checkpoint"]
