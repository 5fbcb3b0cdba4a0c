"""Settings of the adapter: argument > ``SHARDKEEPER_*`` environment > config file > default.

Accelerate's own config YAML rejects unknown top-level keys, and nested unknown keys never
reach the training processes, so shardkeeper reads its own file, ``shardkeeper.yaml``, kept
beside Accelerate's default config (``$HF_HOME/accelerate/shardkeeper.yaml``, i.e.
``~/.cache/huggingface/accelerate/shardkeeper.yaml`` by default), or the file named by
``SHARDKEEPER_CONFIG_FILE``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkeeper.core import options_from_env, options_from_file, options_from_mapping
from shardkeeper.core.adapter import describe_unknown, option_types

CONFIG_FILE_NAME = "shardkeeper.yaml"
CONFIG_FILE_ENV = "SHARDKEEPER_CONFIG_FILE"
ENV_PREFIX = "SHARDKEEPER_"

#: Settings of the adapter itself (not CheckpointOptions), with their types and defaults; read
#: and converted by the core's reader (``shardkeeper.core.config.settings``) like the options.
ADAPTER_SETTINGS: dict[str, tuple[Any, Any]] = {
    "root": (str | None, None),
    "keep_last": (int | None, None),
    "keep_every": (int | None, None),
    "storage_options": (dict[str, Any] | None, None),
    "resume_dataloaders": (bool, True),
    "metadata": (dict[str, Any] | None, None),
}
_ADAPTER_TYPES: dict[str, Any] = {k: t for k, (t, _) in ADAPTER_SETTINGS.items()}
#: Every setting -> its declared type (the CheckpointOptions fields' from the dataclass itself).
SETTING_TYPES: dict[str, Any] = {**_ADAPTER_TYPES, **option_types()}


def accelerate_config_dir() -> Path:
    """The folder of Accelerate's default config file (same rule as ``accelerate config``)."""
    hf_home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(os.path.expanduser(hf_home)) / "accelerate"


def config_file_path() -> Path:
    """``$SHARDKEEPER_CONFIG_FILE`` if set, else ``shardkeeper.yaml`` beside Accelerate's config."""
    explicit = os.environ.get(CONFIG_FILE_ENV)
    return Path(os.path.expanduser(explicit)) if explicit else accelerate_config_dir() / CONFIG_FILE_NAME


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in ``path`` (YAML mapping); empty if the file does not exist."""
    if not path.is_file():
        return {}
    return options_from_file(path, extra=_ADAPTER_TYPES)


def read_env() -> dict[str, Any]:
    """Settings from ``SHARDKEEPER_<NAME>`` variables (``SHARDKEEPER_ASYNC_SAVE=0``, ...)."""
    return options_from_env(prefix=ENV_PREFIX, extra=_ADAPTER_TYPES)


def resolve_settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Merge the sources, highest first: ``arguments`` (None = unset) > env > file > defaults."""
    unknown = [k for k in arguments if k not in SETTING_TYPES]
    if unknown:
        raise TypeError(
            f"unknown shardkeeper.accelerate option(s): {describe_unknown(unknown, SETTING_TYPES)}; "
            f"known: {', '.join(sorted(SETTING_TYPES))}"
        )
    merged: dict[str, Any] = {k: d for k, (_, d) in ADAPTER_SETTINGS.items()}
    merged.update(read_config_file(config_file_path()))
    merged.update(read_env())
    given = {k: v for k, v in arguments.items() if v is not None}
    merged.update(options_from_mapping(given, source="the arguments of enable()", extra=_ADAPTER_TYPES))
    return merged


def split_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter settings, CheckpointOptions overrides)."""
    adapter = {k: settings.get(k) for k in ADAPTER_SETTINGS}
    options = {k: v for k, v in settings.items() if k in option_types()}
    return adapter, options


__all__ = [
    "ADAPTER_SETTINGS",
    "CONFIG_FILE_ENV",
    "CONFIG_FILE_NAME",
    "ENV_PREFIX",
    "SETTING_TYPES",
    "accelerate_config_dir",
    "config_file_path",
    "read_config_file",
    "read_env",
    "resolve_settings",
    "split_settings",
]
