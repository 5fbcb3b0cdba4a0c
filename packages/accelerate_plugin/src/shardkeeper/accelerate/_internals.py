"""Every use of a private Accelerate attribute, in one place, checked against the tested releases.

Accelerate has no public way to list what ``prepare()`` and ``register_for_checkpointing()``
collected (its own ``save_state`` reads the same private lists), nor a hook per batch of a
prepared DataLoader. Each function below reads one such attribute; each was checked on the
releases of ``TESTED_RANGE`` (CI tests its lowest minor and the newest the index serves). ``contract_check`` says which of them an Accelerator has, and
``tests/accelerate/test_internals.py`` asserts all of them on the installed release, so a
release that renames or removes one fails loudly there (bump ``TESTED_RANGE`` only after that
test passes on the new release). ``warn_if_untested`` warns once per process outside the range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from shardkeeper.core.adapter import VersionGate

#: Accelerate releases whose internals this module was verified against: [low, high).
TESTED_RANGE = ((1, 14), (1, 17))
#: The Accelerator's lists of prepared and registered objects (each a ``list``), read live:
#: ``free_memory()`` replaces them with new lists.
ACCELERATOR_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")


class AccelerateInternalsError(RuntimeError):
    """The installed Accelerate does not have the internals this adapter relies on."""


#: The range check and the one warning outside it (``TESTED_RANGE``).
GATE = VersionGate(
    "shardkeeper.accelerate", "Accelerate", "accelerate", TESTED_RANGE, "its internals passed the checks"
)


def version_tested() -> bool:
    return GATE.in_range()


def warn_if_untested() -> None:
    """Warn (once per process) when the installed Accelerate is outside ``TESTED_RANGE``."""
    GATE.warn_if_untested(stacklevel=4)


# -- what prepare() and register_for_checkpointing() collected -------------------------------
def prepared_models(accelerator: Any) -> list[Any]:
    """``accelerator._models``: the prepared models, in prepare order."""
    return cast("list[Any]", accelerator._models)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """``accelerator._optimizers``: the prepared ``AcceleratedOptimizer``s."""
    return cast("list[Any]", accelerator._optimizers)


def prepared_schedulers(accelerator: Any) -> list[Any]:
    """``accelerator._schedulers``: the prepared ``AcceleratedScheduler``s."""
    return cast("list[Any]", accelerator._schedulers)


def prepared_dataloaders(accelerator: Any) -> list[Any]:
    """``accelerator._dataloaders``: the prepared DataLoaders."""
    return cast("list[Any]", accelerator._dataloaders)


def registered_objects(accelerator: Any) -> list[Any]:
    """``accelerator._custom_objects``: what ``register_for_checkpointing`` got."""
    return cast("list[Any]", accelerator._custom_objects)


# -- a DataLoaderShard's batches --------------------------------------------------------------
def hook_per_batch(dl: Any, hook: Callable[[], None]) -> Callable[[], None]:
    """Make ``DataLoaderShard.__iter__`` call ``hook`` where it calls ``self._update_state_dict()``
    (before yielding each batch, and once more before the last one), on this instance only;
    return the original bound method, for ``hook`` to call."""
    original: Callable[[], None] = dl._update_state_dict
    object.__setattr__(dl, "_update_state_dict", hook)  # an instance attribute shadows the method
    return original


def unhook_per_batch(dl: Any) -> None:
    """Undo :func:`hook_per_batch`: the class's ``_update_state_dict`` shows through again."""
    vars(dl).pop("_update_state_dict", None)


# -- the contract -----------------------------------------------------------------------------
def contract_check(accelerator: Any) -> dict[str, bool]:
    """Each private attribute this adapter reads, by name: whether ``accelerator`` (and the
    installed Accelerate) has it as this module expects."""
    from accelerate.data_loader import DataLoaderShard

    present = {f"Accelerator.{n}": isinstance(getattr(accelerator, n, None), list) for n in ACCELERATOR_LISTS}
    present["DataLoaderShard._update_state_dict"] = callable(getattr(DataLoaderShard, "_update_state_dict", None))
    return present


def require_accelerator(accelerator: Any) -> None:
    """``AccelerateInternalsError`` naming every internal ``accelerator`` lacks."""
    missing = sorted(n for n, ok in contract_check(accelerator).items() if not ok)
    if missing:
        import accelerate

        raise AccelerateInternalsError(
            f"Accelerate {accelerate.__version__} lacks internals shardkeeper.accelerate relies on: "
            f"{', '.join(missing)}; this adapter was verified with Accelerate {GATE.range_text()}. Install "
            f"an Accelerate release in that range, or update shardkeeper-accelerate"
        )


__all__ = [
    "TESTED_RANGE",
    "AccelerateInternalsError",
    "contract_check",
    "hook_per_batch",
    "unhook_per_batch",
    "prepared_dataloaders",
    "prepared_models",
    "prepared_optimizers",
    "prepared_schedulers",
    "registered_objects",
    "require_accelerator",
    "version_tested",
    "warn_if_untested",
]
