"""shardkeeper.core: one checkpoint format and one commit protocol for PyTorch training.

``import shardkeeper.core`` is cheap and torch-free; the torch-side names below are loaded
on first use, so the format, storage, commit and CLI work on machines without torch.

The names in ``__all__`` are the public API (docs/api.md): they keep their meaning across
releases. Every other module of the core is internal and may change without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkeeper.core.errors import (
    CatalogError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    ChecksumMismatchError,
    CommitConflictError,
    CorruptCheckpointError,
    EncryptionKeyError,
    ForeignManifestError,
    IncompatibleFormatError,
    StartRefusedError,
    StateMismatchError,
    StepClaimedError,
    StepOrderError,
    StorageError,
    TornStateError,
)
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.util.extras import EXTRA_OF

if TYPE_CHECKING:
    from shardkeeper.core import metrics
    from shardkeeper.core.codec.keys import KeyProvider, LocalKeyProvider
    from shardkeeper.core.commit.catalog import open_catalog
    from shardkeeper.core.config.options import CheckpointOptions, IneffectiveOptionWarning
    from shardkeeper.core.config.settings import options_from_env, options_from_file, options_from_mapping
    from shardkeeper.core.data.sampler import ResumableDistributedSampler
    from shardkeeper.core.hf.importer import import_hf
    from shardkeeper.core.hf.load import load_hf
    from shardkeeper.core.manager.manager import CheckpointManager, SaveHandle
    from shardkeeper.core.restore.per_rank import WorldSizeChangedWarning
    from shardkeeper.core.save.handle import UnwaitedSaveWarning
    from shardkeeper.core.state.flatten import PerRank, RNGState, dtype_from_name, normalize_fqn
    from shardkeeper.core.state.fragment import Fragment
    from shardkeeper.core.state.logical import LogicalPartial, logical_combine, logical_digest, logical_partial
    from shardkeeper.core.state.quantize import quantized
    from shardkeeper.core.tools.advisor import advise, advise_root
    from shardkeeper.core.tools.dcp_import import import_dcp
    from shardkeeper.core.tools.export import export_safetensors
    from shardkeeper.core.tools.preemption import PreemptionGuard

_LAZY = {
    "CheckpointManager": "shardkeeper.core.manager.manager",
    "CheckpointOptions": "shardkeeper.core.config.options",
    "IneffectiveOptionWarning": "shardkeeper.core.config.options",
    "options_from_env": "shardkeeper.core.config.settings",
    "options_from_file": "shardkeeper.core.config.settings",
    "options_from_mapping": "shardkeeper.core.config.settings",
    "SaveHandle": "shardkeeper.core.manager.manager",
    "UnwaitedSaveWarning": "shardkeeper.core.save.handle",
    "WorldSizeChangedWarning": "shardkeeper.core.restore.per_rank",
    "Fragment": "shardkeeper.core.state.fragment",
    "LogicalPartial": "shardkeeper.core.state.logical",
    "logical_combine": "shardkeeper.core.state.logical",
    "logical_digest": "shardkeeper.core.state.logical",
    "logical_partial": "shardkeeper.core.state.logical",
    "PerRank": "shardkeeper.core.state.flatten",
    "RNGState": "shardkeeper.core.state.flatten",
    "normalize_fqn": "shardkeeper.core.state.flatten",
    "dtype_from_name": "shardkeeper.core.state.flatten",
    "export_safetensors": "shardkeeper.core.tools.export",
    "import_dcp": "shardkeeper.core.tools.dcp_import",
    "import_hf": "shardkeeper.core.hf.importer",
    "load_hf": "shardkeeper.core.hf.load",
    "advise": "shardkeeper.core.tools.advisor",
    "advise_root": "shardkeeper.core.tools.advisor",
    "open_catalog": "shardkeeper.core.commit.catalog",
    "PreemptionGuard": "shardkeeper.core.tools.preemption",
    "quantized": "shardkeeper.core.state.quantize",
    "ResumableDistributedSampler": "shardkeeper.core.data.sampler",
    "KeyProvider": "shardkeeper.core.codec.keys",
    "LocalKeyProvider": "shardkeeper.core.codec.keys",
}
#: Public submodules, imported on first use: ``from shardkeeper.core import metrics``.
_LAZY_MODULES = {"metrics": "shardkeeper.core.metrics"}


#: Top-level modules of the ``[torch]`` extra: a lazy name that fails to import one of these
#: says which extra to install, instead of a bare ModuleNotFoundError from deep inside.
_TORCH_EXTRA = frozenset(m for m, extra in EXTRA_OF.items() if extra == "torch")


def _import_lazy(module: str, public: str) -> Any:
    """Import ``module`` for the lazy name ``public``. A missing torch or numpy becomes a
    ModuleNotFoundError (still an ImportError, with ``name`` kept) that names the extra;
    any other import error inside passes through unchanged."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _TORCH_EXTRA:
            raise
        raise ModuleNotFoundError(
            f"shardkeeper.core.{public} needs {missing}, which is not installed: "
            f"pip install 'shardkeeper-core[torch]' (brings torch and numpy), "
            f"or install them yourself (e.g. torch==2.13.0 numpy)",
            name=exc.name,
        ) from exc


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return _import_lazy(_LAZY_MODULES[name], name)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardkeeper.core' has no attribute {name!r}")
    return getattr(_import_lazy(mod, name), name)


__all__ = [
    "CatalogError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "EncryptionKeyError",
    "ForeignManifestError",
    "Fragment",
    "IncompatibleFormatError",
    "IneffectiveOptionWarning",
    "KeyProvider",
    "LocalKeyProvider",
    "LogicalPartial",
    "PerRank",
    "PreemptionGuard",
    "RNGState",
    "ResumableDistributedSampler",
    "SaveHandle",
    "StartRefusedError",
    "StateMismatchError",
    "StepClaimedError",
    "StepOrderError",
    "StorageError",
    "TornStateError",
    "UnwaitedSaveWarning",
    "WorldSizeChangedWarning",
    "advise",
    "advise_root",
    "dtype_from_name",
    "export_safetensors",
    "import_dcp",
    "logical_combine",
    "logical_digest",
    "logical_partial",
    "import_hf",
    "load_hf",
    "metrics",
    "normalize_fqn",
    "open_catalog",
    "options_from_env",
    "options_from_file",
    "options_from_mapping",
    "parse_step_dir",
    "quantized",
    "step_dir",
]
