"""A shardkeeper checkpoint as Lightning's checkpoint dict, in one process: inference loads.

The ``.ckpt`` files the plugin leaves are pointers, not checkpoints: Lightning's own loader
(``torch.load``) finds only a message naming the root and step. :func:`load_checkpoint` reads the step a pointer
(or a root, or a step directory) names and returns the dict ``torch.load`` returns for a
Lightning ``.ckpt``: ``state_dict`` of full CPU tensors (assembled from any saved layout:
ddp, FSDP2/TP shards, FSDP1, DeepSpeed fragments), ``hyper_parameters``, ``epoch``,
``global_step``, loops, callbacks, schedulers, extras and, for a plain optimizer layout,
``optimizer_states`` in torch's own index-keyed form.

:func:`hook_loaders` wraps the function Lightning loads ``.ckpt`` files with (in
``LightningModule.load_from_checkpoint``, ``LightningDataModule.load_from_checkpoint`` and
``TorchCheckpointIO``, so ``trainer.test/validate/predict(ckpt_path=...)`` without the plugin)
so that it sends pointers here and every other file to Lightning's loader unchanged.
``shardkeeper.lightning.install()`` installs the wrapper, ``uninstall()`` removes it.

Nothing here unpickles. The step is read with the core's target-free ``CheckpointManager.load``,
which is not a collective: one process may call it alone, inside a process group or not.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, cast

import torch

from shardkeeper.core import CheckpointManager, parse_step_dir
from shardkeeper.core.adapter import Manifest, Patches, read_progress
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.lightning import _internals as li
from shardkeeper.lightning import codec
from shardkeeper.lightning import strategy as st
from shardkeeper.lightning.paths import Target, check_pointer, is_root, pointed_step, read_pointer


def is_pointer(path: Any) -> bool:
    """Whether ``path`` is a pointer file the plugin wrote (never for a file object or an
    ``http(s)`` URL, which Lightning fetches through ``torch.hub``). A file that starts like a
    pointer (``{``) but is damaged raises :class:`~shardkeeper.core.errors.CorruptCheckpointError`
    rather than going on to ``torch.load``."""
    if not isinstance(path, (str, Path)) or str(path).startswith("http"):
        return False
    return read_pointer(os.fspath(path)) is not None


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = None, **manager_options: Any) -> dict[str, Any]:
    """Lightning's checkpoint dict of the step ``path`` names (a pointer file such as
    ``last.ckpt``, a root: its newest committed step, or ``<root>/step-%012d``).

    ``map_location``: a device or device string, or a ``{"cpu": device}`` dict, moves the
    tensors (a callable, as ``torch.load`` takes, keeps them on the CPU). ``manager_options``
    go to the reading :class:`~shardkeeper.core.CheckpointManager` (``storage_options``, ...).
    """
    s = os.fspath(path)
    target = read_pointer(s)
    if target is not None:
        target = check_pointer(target)
    else:
        head, _, tail = s.rstrip("/").rpartition("/")
        if head and parse_step_dir(tail) is not None:
            target = Target(head, parse_step_dir(tail))
        elif is_root(s):
            target = Target(s, None)
    if target is None:
        raise CheckpointNotFoundError(
            f"{s} is neither a shardkeeper pointer file (a .ckpt the Lightning plugin wrote), a "
            f"checkpoint root nor a step directory under one; a Lightning .ckpt loads with torch.load"
        )
    opts = {"process_group": "local", **st.read_options(manager_options)}  # this process reads alone
    with CheckpointManager(target.root, **opts) as mgr:
        step = pointed_step(target, mgr)  # a pointer's uncommitted step: the newest committed below
        step = step if step is not None else mgr.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {target.root}: nothing to load from {s}")
        manifest = mgr.manifest(step)
        ck = _read(mgr, step, manifest)
    return _mapped(ck, map_location)


def _read(mgr: CheckpointManager, step: int, manifest: Manifest) -> dict[str, Any]:
    leaves = manifest.leaves
    names = [ns for ns in ("model", "optim", "sched", "extra") if any(_under(k, ns) for k in leaves)]
    if "optim" in names and _plain_optim(_objects(leaves, "optim")) is None:
        names.remove("optim")  # another layout (a DeepSpeed engine's): a Trainer with the plugin resumes it
    # the core's target-free load: full tensors from any saved layout, read by this process alone
    state = mgr.load(step, only=[f"{ns}/*" for ns in names]) if names else {}
    ck = lightning_dict(manifest, codec.decode(state.get("extra") or {}), state.get("sched"), step, mgr.storage.url)
    ck["state_dict"] = dict(state.get("model") or {})
    if "optim" in state:
        ck["optimizer_states"] = _plain_optim(state["optim"])
    return ck


def _under(key: str, ns: str) -> bool:
    return key.startswith(ns + "/")


def _objects(leaves: Any, ns: str) -> dict[str, Any]:
    """The JSON leaves under ``ns`` nested by key path, from the manifest alone (no read): enough
    to tell the optimizer layout (``param_groups``) before any tensor is read."""
    out: dict[str, Any] = {}
    for key in leaves:
        if not _under(key, ns):
            continue
        *path, name = key[len(ns) + 1 :].split("/")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            rec = leaves[key]
            node[name] = rec.value if rec.kind == "object" else {}
    return out


def lightning_dict(
    manifest: Manifest, extra: Any, sched: Any, step: int, root: str, stacklevel: int = 4
) -> dict[str, Any]:
    """Lightning's dict, but for ``state_dict`` and ``optimizer_states``, from a step's
    manifest and its restored ``extra`` and ``sched`` entries."""
    import warnings

    import lightning

    info = extra.get("lightning", {}) if isinstance(extra, dict) else {}
    progress = read_progress(manifest)
    ours = progress.of("lightning")
    ck: dict[str, Any] = {
        "epoch": progress.epoch,
        "global_step": progress.step,
        "pytorch-lightning_version": info.get("version") or lightning.__version__,
    }
    if "loops" in ours:
        ck["loops"] = codec.decode(ours["loops"])
    if isinstance(extra, dict):
        if "callbacks" in extra:
            ck["callbacks"] = extra["callbacks"]
        ck.update(extra.get("checkpoint", {}))
    has_optim = any(k.startswith("optim/") for k in manifest.leaves)
    if isinstance(info.get("sched"), dict) or sched is not None:
        s = info["sched"] if isinstance(info.get("sched"), dict) else codec.decode(sched)
        n = info.get("schedulers", 1)
        ck["lr_schedulers"] = [s] if n == 1 else [s[str(i)] if str(i) in s else s[i] for i in range(n)]
    elif has_optim:
        if not info:
            warnings.warn(
                f"step {step} under {root} holds no LR scheduler state (not written "
                f"by the Lightning plugin); schedulers keep their initial state",
                stacklevel=stacklevel,
            )
        ck["lr_schedulers"] = []
    return ck


def _plain_optim(optim: Any) -> list[dict[str, Any]] | None:
    """The optimizers of a restored ``optim`` entry in torch's index-keyed ``state_dict()``
    form (several: ``optim/<i>/...``), or ``None`` for another layout."""
    if not isinstance(optim, dict):
        return None
    parts = [optim] if "param_groups" in optim else [optim.get(str(i)) for i in range(len(optim))]
    out = []
    for o in parts:
        if not isinstance(o, dict):
            return None
        groups = o.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            return None
        fqns = [f for g in groups for f in g.get("params", [])]
        if not all(isinstance(f, str) for f in fqns):
            return None
        index = {f: i for i, f in enumerate(fqns)}
        n = 0
        new_groups = []
        for g in groups:
            k = len(g["params"])
            new_groups.append({**g, "params": list(range(n, n + k))})
            n += k
        saved = o.get("state", {})
        state = {index[f]: dict(v) for f, v in saved.items() if f in index}
        # ascending index, as torch's state_dict() orders it (the saved dict is ordered by name)
        out.append({"state": {i: state[i] for i in sorted(state)}, "param_groups": new_groups})
    return out


def _mapped(ck: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
    if map_location is None or callable(map_location):
        return ck
    device = torch.device(map_location)

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        return x

    return cast("dict[str, Any]", move(ck))


def hook_loaders(patches: Patches) -> None:
    """Wrap Lightning's ``.ckpt`` loader where Lightning calls it (restorable: ``patches``)."""
    for module, name in li.checkpoint_loaders():
        orig = getattr(module, name)

        @functools.wraps(orig)
        def load(
            path_or_url: Any, map_location: Any = None, weights_only: bool | None = None, _orig: Any = orig
        ) -> Any:
            if is_pointer(path_or_url):
                return load_checkpoint(path_or_url, map_location=map_location)
            return _orig(path_or_url, map_location=map_location, weights_only=weights_only)

        patches.set(module, name, load)


__all__ = ["hook_loaders", "is_pointer", "lightning_dict", "load_checkpoint"]
