"""Every private Trainer method this adapter replaces or calls, in one place, checked against
the tested releases.

The Trainer has no storage seam: ``train()`` reads ``<checkpoint>/trainer_state.json`` itself,
and its loaders look for files by name. So the adapter takes over these methods on the
Trainer instance (``plugin.py``), each with the signature listed in ``METHODS``, verified on the
releases of ``TESTED_RANGE`` (CI tests its lowest minor and the newest the index serves):

- ``train`` resolves the resume target itself and hands the Trainer ``None`` (so it opens no
  file), then ``_inner_training_loop`` gets the target back;
- ``_init_training_state`` sets the ``TrainerState`` from the checkpoint and recomputes the
  epochs and batches to skip as the Trainer does (``global_step`` // update steps per epoch);
- ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``,
  ``_load_from_checkpoint`` and ``_load_best_model`` restore from the checkpoint;
- ``_prepare_for_training`` (which calls the loaders once the model is prepared) gets no
  checkpoint under DeepSpeed, where it would call ``deepspeed_load_checkpoint`` on the
  Trainer's own folders; the DeepSpeed engine's state is restored after it;
- ``_save_checkpoint`` saves; it still calls ``store_flos`` (a collective under DDP) and
  records the ``ExportableState`` callbacks as the Trainer does;
- ``_get_train_sampler`` and ``get_train_dataloader`` (each calling the class's own) give the
  Trainer's train loader the world-size independent sampler (``position.py``).

``contract_check`` says which of them the installed Trainer has with those parameters, and
``tests/transformers/test_internals.py`` asserts all of them, so a release that renames or
reshapes one fails loudly there (bump ``TESTED_RANGE`` only after that test passes on it).
"""

from __future__ import annotations

import inspect
from typing import Any

from shardkeeper.core.adapter import VersionGate

#: transformers releases whose internals this module was verified against: [low, high).
TESTED_RANGE = ((5, 23), (5, 26))

#: The private (and public) Trainer methods the adapter replaces or calls, with their parameters.
METHODS: dict[str, tuple[str, ...]] = {
    "train": ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_inner_training_loop": ("batch_size", "args", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_init_training_state": (
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_load_best_model": (),
    "_load_callback_state": (),
    "store_flos": (),
    "_get_train_sampler": ("train_dataset",),
    "get_train_dataloader": (),
}
#: Replaced methods whose replacement calls the class's own (a subclass's override still runs).
WRAPPED = ("_get_train_sampler", "get_train_dataloader")
#: The ``TrainerState`` fields the adapter reads or sets.
STATE_FIELDS = ("global_step", "epoch", "best_global_step", "best_model_checkpoint", "stateful_callbacks")


class TransformersInternalsError(RuntimeError):
    """The installed transformers does not have the Trainer internals this adapter relies on."""


GATE = VersionGate(
    "shardkeeper.transformers", "transformers", "transformers", TESTED_RANGE, "its Trainer internals passed the checks"
)


def warn_if_untested() -> None:
    """Warn (once per process) when the installed transformers is outside ``TESTED_RANGE``."""
    GATE.warn_if_untested(stacklevel=4)


def contract_check(trainer_cls: Any = None) -> dict[str, bool]:
    """Each internal this adapter relies on, by name: whether the installed Trainer (or
    ``trainer_cls``) has it as this module expects."""
    import dataclasses

    from transformers import Trainer, TrainerState
    from transformers.trainer_callback import ExportableState

    cls = trainer_cls or Trainer
    out: dict[str, bool] = {}
    for name, params in METHODS.items():
        fn = getattr(cls, name, None)
        ok = callable(fn)
        if fn is not None and ok:
            got = [p for p in inspect.signature(fn).parameters if p != "self"]
            ok = got[: len(params)] == list(params)
        out[f"Trainer.{name}"] = ok
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    for name in STATE_FIELDS:
        out[f"TrainerState.{name}"] = name in fields
    out["ExportableState.state"] = callable(getattr(ExportableState, "state", None))
    return out


def require_trainer(trainer: Any) -> None:
    """``TransformersInternalsError`` naming every internal the installed Trainer lacks (the
    ``transformers.Trainer`` class: a subclass may wrap a method as ``(*args, **kwargs)``)."""
    missing = sorted(n for n, ok in contract_check().items() if not ok)
    if missing:
        raise TransformersInternalsError(
            f"transformers {GATE.version()} lacks Trainer internals shardkeeper.transformers relies on: "
            f"{', '.join(missing)}; this adapter was verified with transformers {GATE.range_text()}. Install a "
            f"transformers release in that range, or update shardkeeper-transformers"
        )


class Originals:
    """The Trainer class's own methods that ``replace_methods`` shadows on an instance, by
    public names, for the replacements to call."""

    def __init__(self, cls: Any) -> None:
        self.train = cls.train
        self.inner_training_loop = cls._inner_training_loop
        self.init_training_state = cls._init_training_state
        self.prepare_for_training = cls._prepare_for_training
        self.load_optimizer_and_scheduler = cls._load_optimizer_and_scheduler
        self.load_scaler = cls._load_scaler
        self.load_rng_state = cls._load_rng_state
        self.load_from_checkpoint = cls._load_from_checkpoint
        self.load_best_model = cls._load_best_model
        self.get_train_sampler = cls._get_train_sampler
        self.get_train_dataloader = cls.get_train_dataloader


def replace_methods(patches: Any, trainer: Any, fns: dict[str, Any]) -> None:
    """Shadow the Trainer's methods on ``trainer`` with ``fns`` (keyed by ``Originals``'
    names, plus ``save_checkpoint``), recorded in ``patches`` (``restore()`` undoes them)."""
    names = {
        "train": "train",
        "inner_training_loop": "_inner_training_loop",
        "init_training_state": "_init_training_state",
        "prepare_for_training": "_prepare_for_training",
        "save_checkpoint": "_save_checkpoint",
        "load_optimizer_and_scheduler": "_load_optimizer_and_scheduler",
        "load_scaler": "_load_scaler",
        "load_rng_state": "_load_rng_state",
        "load_from_checkpoint": "_load_from_checkpoint",
        "load_best_model": "_load_best_model",
        "get_train_sampler": "_get_train_sampler",
        "get_train_dataloader": "get_train_dataloader",
    }
    if set(fns) != set(names):
        raise ValueError(f"replace_methods: expected {sorted(names)}, got {sorted(fns)}")
    for key, name in names.items():
        patches.set(trainer, name, fns[key])


def warn_if_overridden(cls: Any) -> None:
    """Warn when a Trainer subclass overrides a method ``replace_methods`` shadows on the
    instance: that override would no longer run (what it adds to a checkpoint, e.g. files
    beside it, would silently go missing)."""
    import warnings

    from transformers import Trainer

    if Trainer not in cls.__mro__:
        return
    replaced = sorted(set(METHODS) - {"store_flos", "_load_callback_state", *WRAPPED})
    own = [
        f"{klass.__name__}.{name}"
        for name in replaced
        for klass in cls.__mro__[: cls.__mro__.index(Trainer)]
        if name in vars(klass)
    ]
    if own:
        warnings.warn(
            f"shardkeeper.transformers: {', '.join(own)} override(s) Trainer method(s) that enable() replaces on "
            f"this Trainer, so they no longer run: what they add to a checkpoint is not saved. Move that work into "
            f"a TrainerCallback (on_save), or do not enable shardkeeper on this Trainer",
            UserWarning,
            stacklevel=3,
        )


def builds_own_train_sampler(cls: Any) -> bool:
    """Whether the Trainer class ``cls`` builds its train sampler with the Trainer's own
    ``_get_train_sampler`` (not a subclass's override)."""
    from transformers import Trainer

    return bool(cls._get_train_sampler is Trainer._get_train_sampler)


def load_callback_state(trainer: Any) -> None:
    """``Trainer._load_callback_state``: the saved callback states, where
    ``args.restore_callback_states_from_checkpoint`` asks for them."""
    trainer._load_callback_state()


def exportable_callbacks(trainer: Any) -> list[Any]:
    """The callbacks (and the ``TrainerControl``) whose state the Trainer records on save."""
    from transformers.trainer_callback import ExportableState

    return [cb for cb in [*trainer.callback_handler.callbacks, trainer.control] if isinstance(cb, ExportableState)]


def record_callback_states(trainer: Any) -> None:
    """What ``_save_checkpoint`` does before writing ``trainer_state.json``: each exportable
    callback's ``state()`` into ``state.stateful_callbacks``."""
    stateful = trainer.state.stateful_callbacks
    for cb in exportable_callbacks(trainer):
        name = type(cb).__name__
        if isinstance(stateful.get(name), list):
            stateful[name].append(cb.state())
        else:
            stateful[name] = cb.state()


__all__ = [
    "METHODS",
    "Originals",
    "load_callback_state",
    "replace_methods",
    "STATE_FIELDS",
    "builds_own_train_sampler",
    "TESTED_RANGE",
    "TransformersInternalsError",
    "WRAPPED",
    "contract_check",
    "exportable_callbacks",
    "record_callback_states",
    "require_trainer",
    "warn_if_overridden",
    "warn_if_untested",
]
