"""``attach(engine, root)``: the engine's own ``save_checkpoint`` / ``load_checkpoint`` calls
go through shardkeeper (async, atomically committed, verified; local disk, S3, GCS).

The hook replaces both methods on the engine object: DeepSpeed writes ``latest`` with plain
``open()``, globs model files and copies ``zero_to_fp32.py`` outside its ``checkpoint_engine``
slot, so owning the slot alone would still write DeepSpeed's files. Nothing of DeepSpeed's
own format is written or read while attached; ``detach()`` puts the originals back.

The engine's first ``backward`` or ``step`` (before the first training step, after any
``load_checkpoint``) checks the root: a fresh run on a root holding later steps could save
none of its checkpoints there, and is refused with the remedies instead of at its first save.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardkeeper.core import (
    CheckpointManager,
    CheckpointNotFoundError,
    StateMismatchError,
    dtype_from_name,
    options_from_mapping,
)
from shardkeeper.core.adapter import Patches, RootManagers, check_save_step, check_start
from shardkeeper.deepspeed import _ds_internals as dsi
from shardkeeper.deepspeed.state import FRAMEWORK, engine_state

log = logging.getLogger(__name__)

_TAG = re.compile(r"(?:global_step)?(\d+)")
CLIENT_PREFIX = "extra/client_state"
#: The DeepSpeed config section ``attach`` reads its defaults from.
CONFIG_KEY = "shardkeeper"
#: Keys of that section besides the CheckpointOptions fields: the root and the manager's own
#: arguments, with their types (converted and checked by the core's settings reader).
SECTION_SETTINGS: dict[str, Any] = {
    "root": str | None,
    "keep_last": int | None,
    "keep_every": int | None,
    "storage_options": dict[str, Any] | None,
    "metadata": dict[str, Any] | None,
}


def tag_to_step(tag: Any) -> int | None:
    """A numeric tag (``1200``, ``"1200"``) or ``"global_step1200"`` -> 1200; other tags -> None."""
    if isinstance(tag, int) and not isinstance(tag, bool):
        return tag
    if tag is None:
        return None
    m = _TAG.fullmatch(str(tag))
    return int(m.group(1)) if m else None


def _rebuild(prefix: str, leaves: Mapping[str, Any]) -> dict[str, Any]:
    """A restore target for every saved leaf under ``prefix``: empty tensors and placeholders."""
    root: dict[str, Any] = {}
    for key, rec in leaves.items():
        if key != prefix and not key.startswith(prefix + "/"):
            continue
        parts = key[len(prefix) :].strip("/").split("/") if key != prefix else []
        if rec.kind == "tensor":
            value: Any = torch.empty(tuple(rec.shape), dtype=dtype_from_name(rec.dtype))
        elif rec.kind == "bytes":
            value = b""
        else:
            value = None
        if not parts:
            return {"": value}
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return root


def _lists_back(x: Any) -> Any:
    """Dicts keyed "0".."n-1" were lists holding tensors when saved: make them lists again."""
    if isinstance(x, dict):
        x = {k: _lists_back(v) for k, v in x.items()}
        if x and all(k.isdigit() for k in x) and sorted(int(k) for k in x) == list(range(len(x))):
            return [x[str(i)] for i in range(len(x))]
    return x


class DeepSpeedCheckpointHook:
    """What ``attach`` returns: owns the managers; ``wait()``, ``close()``, ``detach()``."""

    def __init__(self, engine: Any, root: str | None, **manager_options: Any) -> None:
        dsi.require_engine(engine)
        self.engine = engine
        self.root = root
        self.manager_options = manager_options
        import deepspeed

        e = engine
        self.managers = RootManagers(
            FRAMEWORK,
            deepspeed.__version__,
            manager_options,
            per_rank_call="attach(engine, per_rank=...)",
            zero_stage=dsi.zero_stage(e),
            dtype="bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32",
            dp_world_size=int(e.dp_world_size),
        )
        self._patches = Patches()
        self._patches.set(engine, "save_checkpoint", self.save_checkpoint)
        self._patches.set(engine, "load_checkpoint", self.load_checkpoint)
        self.started = False  # the roots were checked before the first training step (or a save ran)
        self.loaded = False  # load_checkpoint restored a step
        for name in ("backward", "step"):
            self._patches.set(engine, name, self._checked(getattr(engine, name)))

    # -- managers --------------------------------------------------------------------------
    def manager(self, directory: str | None = None) -> CheckpointManager:
        """The manager for ``directory`` (the attach root wins when one was given)."""
        root = self.root if self.root is not None else directory
        if root is None:
            raise ValueError(
                "no checkpoint root: pass one to attach(engine, root) or a directory to "
                "save_checkpoint / load_checkpoint"
            )
        return self.managers.get(str(root))

    def check_start(self) -> None:
        """Before the first training step (every rank): refuse a run whose step count
        (``engine.global_steps``) lies below the newest committed step of its root (the
        attach root; without one, the directories ``load_checkpoint`` was given): it could
        save nothing there (the core's ``check_start``). A save checks its own step."""
        for mgr in [self.manager()] if self.root is not None else list(self.managers):
            url = mgr.storage.url
            check_start(
                mgr,
                int(self.engine.global_steps),
                "shardkeeper.deepspeed",
                resume=f"engine.load_checkpoint({url!r}) before training",
                elsewhere="attach(engine, <another root>)",
                resumed=self.loaded,
            )
        self.started = True

    def _checked(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (the engine's ``backward`` / ``step``), checking the roots first once."""

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.started:
                self.check_start()
            return method(*args, **kwargs)

        return call

    # -- the engine's methods --------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | None = None,
        tag: Any = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """``engine.save_checkpoint``: stages and returns; writes and commits in the background.

        The step is the tag's number (``1200`` / ``"global_step1200"``), else
        ``engine.global_steps``; the tag itself goes into the manifest's metadata.
        ``save_latest`` is implied (the core keeps a LATEST hint; discovery uses manifests).
        """
        mgr = self.manager(save_dir)
        step = tag_to_step(tag)
        at = int(self.engine.global_steps)
        if step is None:
            step = at
        elif step != at:  # saved ahead of (or behind) the count the next saves follow: a trap
            raise ValueError(
                f"DeepSpeed save_checkpoint (tag {tag!r}, rank {mgr.rank}) under {mgr.storage.url}: a numeric tag "
                f"is the step it saves, {step}, but the engine is at global step {at}, which a resume restores "
                f"and the next saves count from; a step of another count would leave them below it and "
                f"refused. Nothing was saved. Pass tag=None (step {at}), tag='global_step{at}', or a name "
                f"that is not a number (tag='epoch3'; load_checkpoint(tag='epoch3') finds it)"
            )
        check_save_step(mgr, step).raise_if_refused(
            f"DeepSpeed save_checkpoint (tag {tag!r})",
            "engine.load_checkpoint(root) resumes the engine's step count from the root.",
        )
        self.started = True  # this run's saves check their own steps from now on
        state = engine_state(self.engine)
        if exclude_frozen_parameters:
            state["model"].exclude_frozen = True
        state["extra"] = {"client_state": dict(client_state or {})}
        tag_name = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        mgr.save(step, state, metadata={"tag": tag_name})
        return True

    def load_checkpoint(
        self,
        load_dir: str | None = None,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """``engine.load_checkpoint``: returns ``(load_path, client_state)``, or ``(None, None)``
        when nothing is committed yet (as DeepSpeed does)."""
        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn is not supported while shardkeeper is attached; detach() first")
        mgr = self.manager(load_dir)
        try:
            found: tuple[int | None, str | None] = (self._resolve_step(mgr, tag), None)
        except CheckpointNotFoundError as e:
            found = (None, str(e))
        step, error = _rank0_says(found)
        if error is not None:
            raise CheckpointNotFoundError(error)
        if step is None:
            warnings.warn(f"no committed checkpoint under {mgr.storage.url}; nothing loaded", stacklevel=2)
            return None, None
        manifest = mgr.manifest(step)
        state = engine_state(self.engine)
        check_model_matches(state, manifest.leaves, where=f"{mgr.step_url(step)} (step {step})")
        only = ["model/*"]
        if not load_module_only:
            only.append("progress/*")
            if load_optimizer_states:
                only.append("optim/*")
            if load_lr_scheduler_states and "sched" in state:
                only.append("sched/*")
        client_target = _rebuild(CLIENT_PREFIX, manifest.leaves)
        if client_target:  # returned also with load_module_only, as DeepSpeed does
            state["extra"] = {"client_state": client_target.get("", client_target)}
            only.append(f"{CLIENT_PREFIX}*")
        mgr.restore(state, step=step, only=only, strict=load_module_strict)
        self.loaded = True
        client = state.get("extra", {}).get("client_state")
        return mgr.step_url(step), _lists_back(client) if client is not None else {}

    def _resolve_step(self, mgr: CheckpointManager, tag: Any) -> int | None:
        if tag is None:
            return mgr.latest_step()
        step = tag_to_step(tag)
        if step is not None:
            if not mgr.is_committed(step):
                steps = mgr.steps()
                raise CheckpointNotFoundError(
                    f"tag {tag!r} (step {step}) is not committed under {mgr.storage.url}; committed steps: {steps[-8:]}"
                )
            return step
        steps = mgr.steps()
        for s in reversed(steps):
            if mgr.manifest(s).metadata.get("tag") == str(tag):
                return s
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {mgr.storage.url} was saved with tag {tag!r}; committed steps: {steps[-8:]}"
        )

    # -- lifecycle -------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every pending save is committed (re-raises a background failure)."""
        self.managers.wait()

    def close(self) -> None:
        self.managers.close()

    def detach(self) -> None:
        """Wait for pending saves, close, and give the engine its own methods back."""
        try:
            self.close()
        finally:
            self._patches.restore()


def _rank0_says(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (storage listings may differ for a moment)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def check_model_matches(state: Mapping[str, Any], leaves: Mapping[str, Any], *, where: str) -> None:
    """Raise one error listing every model parameter whose name or shape does not match."""
    target = {}
    for name, v in state["model"].state_dict().items():
        shape = getattr(v, "global_shape", None)
        target[f"model/{name}"] = tuple(shape if shape is not None else v.shape)
    saved = {k: tuple(r.shape) for k, r in leaves.items() if k.startswith("model/") and r.kind == "tensor"}
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(set(saved) - set(target))
    wrong = sorted(k for k in set(target) & set(saved) if target[k] != saved[k])
    if not (missing or unexpected or wrong):
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    lines = [f"the checkpoint at {where} does not match the engine's model (rank {rank}):"]
    if missing:
        lines.append(f"  in the engine, not in the checkpoint: {', '.join(missing)}")
    if unexpected:
        lines.append(f"  in the checkpoint, not in the engine: {', '.join(unexpected)}")
    for k in wrong:
        lines.append(f"  {k}: checkpoint shape {list(saved[k])}, engine shape {list(target[k])}")
    lines.append("build the model with the configuration the checkpoint was saved with")
    raise StateMismatchError("\n".join(lines))


def config_settings(engine: Any) -> dict[str, Any]:
    """The settings of the ``"shardkeeper"`` section of the engine's DeepSpeed config, each
    converted to its type; unknown keys and ill-typed values are errors naming the section."""
    section = dsi.config_dict(engine).get(CONFIG_KEY)
    return options_from_mapping(
        section or {}, source=f"the DeepSpeed config's {CONFIG_KEY!r} section", extra=SECTION_SETTINGS
    )


def attach(engine: Any, root: str | None = None, **manager_options: Any) -> DeepSpeedCheckpointHook:
    """Route ``engine.save_checkpoint`` / ``engine.load_checkpoint`` through shardkeeper.

    ``root``: where checkpoints go (a path, ``s3://...``, ``gs://...``); None uses the
    directory passed to each call. ``manager_options`` go to ``CheckpointManager``
    (``keep_last=3``, ``async_save=False``, ``storage_options=...``). Both may also come from
    a ``"shardkeeper"`` section of the DeepSpeed config (``{"root": ..., "keep_last": 3}``);
    arguments given here win.
    """
    settings = config_settings(engine)
    if root is None:
        root = settings.pop("root", None)
    settings.pop("root", None)
    return DeepSpeedCheckpointHook(engine, root, **{**settings, **manager_options})


__all__ = ["DeepSpeedCheckpointHook", "attach", "check_model_matches", "tag_to_step"]
