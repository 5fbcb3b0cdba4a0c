"""The contract every framework adapter follows, owned by the core.

One place for the rules the three adapters used to write each on their own:

- :mod:`.roots`: one manager per root, with the adapter's options and the same manifest
  metadata (``framework``, versions, ``progress_schema``);
- :mod:`shardkeeper.core.format.progress`: one progress schema (``progress/step``, ``progress/epoch``,
  ``progress/samples``, ``progress/<framework>/...``), so a resume under any framework
  continues the step count of the checkpoint it came from;
- :mod:`.steps`: the decision whether a save at a step may go ahead (refused when the step is
  committed or below the newest committed one), agreed by every rank;
- :mod:`.start`: the same decision for a whole run, before its first training step (a fresh
  run on a root that holds later steps is refused with the remedies, not at its first save);
- :mod:`.patching`: restorable patches of framework methods (every adapter can detach);
- :mod:`.versions`: the framework versions an adapter's internals module was verified on;
- :func:`require_trust`: the one gate before anything may be unpickled (legacy importers).

The core never imports a framework: adapters pass their framework's name and version in.
"""

from shardkeeper.core.adapter.patching import Patches
from shardkeeper.core.adapter.registry import available_adapters, load_adapter
from shardkeeper.core.adapter.roots import RootManagers, adapter_metadata
from shardkeeper.core.adapter.start import check_start
from shardkeeper.core.adapter.steps import StepCheck, agree, check_save_step
from shardkeeper.core.adapter.versions import VersionGate, in_range, parse_version
from shardkeeper.core.format.progress import (
    PROGRESS_SCHEMA,
    Progress,
    ProgressTarget,
    framework_of,
    object_tree,
    progress_state,
    read_progress,
)
from shardkeeper.core.state.unpickle import require_trust

__all__ = [
    "PROGRESS_SCHEMA",
    "Patches",
    "Progress",
    "ProgressTarget",
    "RootManagers",
    "StepCheck",
    "VersionGate",
    "adapter_metadata",
    "agree",
    "available_adapters",
    "check_save_step",
    "check_start",
    "framework_of",
    "in_range",
    "load_adapter",
    "object_tree",
    "parse_version",
    "progress_state",
    "read_progress",
    "require_trust",
]
