"""The contract every framework adapter follows, owned by the core, and all an adapter imports
from the core besides ``shardkeeper.core``'s public names and ``shardkeeper.core.errors`` (an
import-linter contract holds the adapters to that).

One place for the rules the adapters used to write each on their own:

- :mod:`.roots`: one manager per root, with the adapter's options and the same manifest
  metadata (``framework``, versions, ``progress_schema``);
- one progress schema (``progress/step``, ``progress/epoch``, ``progress/samples``,
  ``progress/<framework>/...``), so a resume under any framework continues the step count of
  the checkpoint it came from;
- :mod:`.steps`: the decision whether a save at a step may go ahead (refused when the step is
  committed or below the newest committed one), agreed by every rank;
- :mod:`.start`: the same decision for a whole run, before its first training step (a fresh
  run on a root that holds later steps is refused with the remedies, not at its first save);
- :mod:`.patching`: restorable patches of framework methods (every adapter can detach);
- :mod:`.versions`: the framework versions an adapter's internals module was verified on;
- :func:`require_trust`: the one gate before anything may be unpickled (legacy importers,
  with :func:`load_trusted_pickle` and :func:`load_dcp` behind it).

And what adapters build on beside it: the types of what a manager hands out (``Manifest``
from ``mgr.manifest()``, read only; ``RetentionPolicy``, ``mgr.retention``), the option
reader's helpers for adapter settings, pointer files (a torch-loadable file naming a root and
step), files written whole or not at all, ``ExportResult``, and ``OptimizerHolder`` (the
method a state object implements when it holds optimizers the state does not show, so that
overlapped staging gates their ``step()``).

And the train data's position (``shardkeeper.core.data``): where every adapter keeps it
(``DATA_POSITION_KEY``, one layout), and the epoch's order and one rank's part of its rest,
for an adapter that splits the rest itself.

The core never imports a framework: adapters pass their framework's name and version in.
"""

from shardkeeper.core.adapter.patching import Patches
from shardkeeper.core.adapter.registry import available_adapters, load_adapter
from shardkeeper.core.adapter.roots import RootManagers, adapter_metadata
from shardkeeper.core.adapter.start import check_start
from shardkeeper.core.adapter.steps import StepCheck, check_save_step
from shardkeeper.core.adapter.versions import VersionGate, in_range, parse_version
from shardkeeper.core.config.options import describe_unknown, option_types
from shardkeeper.core.data.order import epoch_order, rank_part
from shardkeeper.core.data.position import DATA_POSITION_KEY, DISTRIBUTED_ORDER, count_problems
from shardkeeper.core.data.position import KEYS as POSITION_KEYS
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.pointer import (
    MAX_POINTER_BYTES,
    POINTER_VERSION,
    PointerDamagedError,
    encode_pointer,
    looks_like_pointer,
    pointer_document,
    pointer_format,
    pointer_message,
)
from shardkeeper.core.format.progress import (
    PROGRESS_SCHEMA,
    Progress,
    ProgressTarget,
    framework_of,
    object_tree,
    progress_state,
    read_progress,
)
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.save.overlap import OptimizerHolder
from shardkeeper.core.state.unpickle import load_trusted_pickle, possible_pickles, require_trust
from shardkeeper.core.storage.safe_files import move_in, write_file
from shardkeeper.core.tools.dcp_import import load_dcp
from shardkeeper.core.tools.export import ExportResult

__all__ = [
    "DATA_POSITION_KEY",
    "DISTRIBUTED_ORDER",
    "POSITION_KEYS",
    "ExportResult",
    "MAX_POINTER_BYTES",
    "Manifest",
    "OptimizerHolder",
    "POINTER_VERSION",
    "PROGRESS_SCHEMA",
    "Patches",
    "PointerDamagedError",
    "Progress",
    "ProgressTarget",
    "RetentionPolicy",
    "RootManagers",
    "StepCheck",
    "VersionGate",
    "adapter_metadata",
    "available_adapters",
    "check_save_step",
    "check_start",
    "describe_unknown",
    "encode_pointer",
    "count_problems",
    "epoch_order",
    "framework_of",
    "in_range",
    "load_adapter",
    "load_dcp",
    "load_trusted_pickle",
    "looks_like_pointer",
    "move_in",
    "object_tree",
    "option_types",
    "parse_version",
    "pointer_document",
    "pointer_format",
    "pointer_message",
    "possible_pickles",
    "progress_state",
    "rank_part",
    "read_progress",
    "require_trust",
    "write_file",
]
