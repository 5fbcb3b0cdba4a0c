"""The manager options of the kill -9 campaign's writers (``campaign``): its defaults, what
``--manager-options`` may override, and the check that a manager takes them, made before any
writer starts (a writer that cannot be built would fail every trial)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: The writers' manager options that ``--manager-options`` may override (and, with ``--local``,
#: the tier's); ``async_save`` is drawn per trial unless given.
DEFAULTS: dict[str, Any] = {"keep_last": 2}
TIER_DEFAULTS: dict[str, Any] = {"local_keep": 2, "persist_every": 2}

#: Manager options the campaign decides itself: where the writer writes and how it is killed;
#: and the key, which its checks (verify, restore, gc on the root) do not use.
FIXED_OPTIONS = frozenset({"storage_options", "local", "encryption", "encryption_root"})


def _scratch_local(scratch_root: str, root: str, local: str) -> str:
    """Where the scratch manager's local tier goes: beside its root, or inside it at the same
    place when ``local`` lies inside ``root`` (which a manager refuses: so is the campaign)."""
    if "://" not in root:
        real_root, real_local = os.path.realpath(root), os.path.realpath(local)
        if os.path.commonpath([real_root, real_local]) == real_root:
            return os.path.join(scratch_root, os.path.relpath(real_local, real_root))
    return os.path.join(os.path.dirname(scratch_root), "local")


def check_manager_options(given: Any, local: str | None, root: str = "") -> dict[str, Any]:
    """``given`` checked before any writer starts: ``CheckpointManager`` keywords the
    campaign does not fix itself (``keep_last``, ``async_save`` and a tier's ``local_keep`` and
    ``persist_every`` override its defaults; ``async_save`` then holds for every trial), with
    values a manager takes: one is built with them on a scratch directory, as each writer's is."""
    import inspect
    import tempfile

    from shardkeeper.core import CheckpointManager

    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"manager options must be a JSON object of CheckpointManager keywords, not {given!r}")
    known = set(inspect.signature(CheckpointManager).parameters) - {"root", "self"}
    opts = dict(given or {})
    for name in opts:
        if name in FIXED_OPTIONS:
            raise ValueError(
                f"manager option {name!r} is the campaign's own (ROOT, --storage-options and --local say where "
                f"it writes; its checks read the root without a key); remove it from --manager-options"
            )
        if name not in known:
            raise ValueError(
                f"manager option {name!r} is not a CheckpointManager keyword; the campaign would fail in "
                f"every writer. Known: {', '.join(sorted(known - FIXED_OPTIONS))}"
            )
    with tempfile.TemporaryDirectory(prefix="shardkeeper-campaign-") as scratch:
        scratch_root = os.path.join(scratch, "root")
        scratch_local = _scratch_local(scratch_root, root, local) if local else ""
        tier: dict[str, Any] = {"local": scratch_local, **TIER_DEFAULTS} if local else {}
        try:
            CheckpointManager(scratch_root, **{**DEFAULTS, **tier, **opts}).close()
        except Exception as e:  # said with the real paths, not the scratch ones
            msg = str(e)
            if local:
                msg = msg.replace(scratch_local, local)
            msg = msg.replace(scratch_root, root or "ROOT")
            raise ValueError(
                f"CheckpointManager refuses the writers' manager (manager options {opts}"
                f"{', --local ' + local if local else ''}): {msg}"
            ) from e
    return opts


__all__ = ["DEFAULTS", "FIXED_OPTIONS", "TIER_DEFAULTS", "check_manager_options"]
