"""Checks of the arguments of ``CheckpointManager`` and its public methods, before any work.

A swapped or mistyped argument (``restore(2, state)``, ``save(state, 3)``,
``CheckpointManager(root, metadata=[1])``) would otherwise fail deep inside with a message
about a comparison, a dict update or a dump of a model's repr. These name the argument, what
it takes, the type that was passed (never a repr of a model) and the right call form. Steps
and counts take any integral type (``numpy.int64`` from ``np.arange``) through
``operator.index``, and come back as ``int``. Torch-free at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, overload

from shardkeeper.core.config.options import CheckpointOptions, describe_groups
from shardkeeper.core.runtime.root_check import check_manager_root
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.ints import integral

#: How each method is called, for the messages.
CALL_FORMS = {
    "save": "mgr.save(step, state)",
    "restore": "mgr.restore(state, step=None)",
    "load": "mgr.load(step=None, only=None)",
    "delete": "mgr.delete(step)",
    "manifest": "mgr.manifest(step=None)",
    "is_committed": "mgr.is_committed(step)",
    "step_url": "mgr.step_url(step)",
    "should_save": "mgr.should_save(step)",
}


def _kind(value: Any) -> str:
    """``int 3`` for a number, ``str '3'`` for short text, the type's name for anything else
    (a model's repr is huge)."""
    if isinstance(value, (bool, int, float)) or value is None or (isinstance(value, str) and len(value) <= 40):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


@overload
def check_step(method: str, step: Any) -> int: ...
@overload
def check_step(method: str, step: Any, *, optional: bool) -> int | None: ...
def check_step(method: str, step: Any, *, optional: bool = False) -> int | None:
    """``step`` as an int: a non-negative integral value (not a bool); None too when ``optional``."""
    if step is None and optional:
        return None
    form = CALL_FORMS[method]
    if isinstance(step, Mapping):
        raise TypeError(f"{method}(): step must be an int, got a {type(step).__name__} (the state?); call it as {form}")
    value = integral(step)
    if value is None:
        accepted = "an int >= 0 or None" if optional else "an int >= 0"
        raise TypeError(f"{method}(): step must be {accepted}, got {_kind(step)}; call it as {form}")
    if value < 0:
        raise ValueError(f"{method}(): step must be >= 0, got {value}; call it as {form}")
    return value


def check_state(method: str, state: Any) -> None:
    """``state`` is a mapping of names to values (a swapped step and state say so)."""
    if isinstance(state, Mapping):
        return
    form = CALL_FORMS[method]
    swapped = isinstance(state, int) and not isinstance(state, bool)
    hint = " (the step? the state comes " + ("second" if method == "save" else "first") + ")" if swapped else ""
    example = "{'model': model, 'optim': optimizer}"
    raise TypeError(
        f"{method}(): state must be a mapping of names to values such as {example}, got "
        f"{_kind(state)}{hint}; call it as {form}"
    )


#: ``CheckpointManager``'s own keywords (every other one is a ``CheckpointOptions`` field).
MANAGER_PARAMETERS = (
    "keep_last",
    "keep_every",
    "process_group",
    "storage_options",
    "metadata",
    "options",
    "local",
    "persist_every",
    "replicas",
    "erasure",
    "local_keep",
)


def _refuse(name: str, takes: str, value: Any, where: str = "CheckpointManager()", remedy: str = "") -> None:
    raise TypeError(f"{where}: {name} must be {takes}, got {_kind(value)}{remedy and f'; {remedy}'}")


def check_count(name: str, value: Any, where: str = "CheckpointManager()", remedy: str = "") -> int | None:
    """``keep_last`` / ``keep_every`` (and the tiers' counts) as an int or None: a wrong type
    is a ``TypeError``, a count below 1 a ``ValueError``; both start with ``where`` (who
    refuses) and end with ``remedy`` when given."""
    if value is None:
        return None
    count = integral(value)
    if count is None:
        _refuse(name, "an int >= 1 or None", value, where, remedy)
    elif count < 1:
        raise ValueError(f"{where}: {name} must be >= 1 or None (no limit), got {count}{remedy and f'; {remedy}'}")
    return count


def check_replicas(value: Any, where: str = "CheckpointManager()", remedy: str = "") -> int:
    """``replicas``: an int >= 0 (refusals as ``check_count``'s)."""
    count = integral(value)
    if count is None:
        _refuse("replicas", "an int >= 0", value, where, remedy)
    elif count < 0:
        raise ValueError(f"{where}: replicas must be >= 0, got {count}{remedy and f'; {remedy}'}")
    assert count is not None
    return count


def check_manager_arguments(
    *, root: Any, storage_options: Any, metadata: Any, options: Any, process_group: Any
) -> None:
    """The types of the manager's root and own keywords other than the counts (``check_count``),
    and the usual mistakes about the root (``root_check``: a step directory, a pointer file)."""
    if not isinstance(root, (str, os.PathLike, Storage)):
        _refuse("root", "a path (str or os.PathLike), an fsspec URL or a Storage", root)
    if not isinstance(root, Storage):
        check_manager_root(os.fspath(root))
    for name, value in (("storage_options", storage_options), ("metadata", metadata)):
        if value is not None and not isinstance(value, Mapping):
            _refuse(name, "a mapping (dict) or None", value)
    if options is not None and not isinstance(options, CheckpointOptions):
        hint = " (pass the options as keywords, or CheckpointOptions(**that))" if isinstance(options, Mapping) else ""
        raise TypeError(f"CheckpointManager(): options must be a CheckpointOptions or None, got {_kind(options)}{hint}")
    if process_group is None or isinstance(process_group, str):  # a str other than "local": make_coordinator
        return
    import torch.distributed as dist  # only here: the module stays torch-free at import

    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        _refuse("process_group", "a torch.distributed ProcessGroup, None or 'local'", process_group)


def describe_keywords() -> str:
    """The manager's keywords for an unknown-keyword error: its own, then the options by group."""
    return f"the manager's own: {', '.join(MANAGER_PARAMETERS)}; the options, by group: {describe_groups()}"


__all__ = [
    "CALL_FORMS",
    "MANAGER_PARAMETERS",
    "check_count",
    "check_replicas",
    "check_manager_arguments",
    "check_state",
    "check_step",
    "describe_keywords",
]
