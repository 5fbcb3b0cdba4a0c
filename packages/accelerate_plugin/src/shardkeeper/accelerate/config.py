"""Settings of the adapter: argument > ``SHARDKEEPER_*`` environment > config file > default.

Accelerate's own config YAML rejects unknown top-level keys, and nested unknown keys never
reach the training processes, so shardkeeper reads its own file, ``shardkeeper.yaml``, kept
beside Accelerate's default config (``$HF_HOME/accelerate/shardkeeper.yaml``, i.e.
``~/.cache/huggingface/accelerate/shardkeeper.yaml`` by default), or the file named by
``SHARDKEEPER_CONFIG_FILE``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from shardkeeper.core.manager import CheckpointOptions

CONFIG_FILE_NAME = "shardkeeper.yaml"
CONFIG_FILE_ENV = "SHARDKEEPER_CONFIG_FILE"
ENV_PREFIX = "SHARDKEEPER_"

#: Settings of the adapter itself (not CheckpointOptions), with their types and defaults.
ADAPTER_SETTINGS: dict[str, tuple[type, Any]] = {
    "root": (str, None),
    "keep_last": (int, None),
    "keep_every": (int, None),
    "storage_options": (dict, None),
    "resume_dataloaders": (bool, True),
}
#: CheckpointOptions field annotation -> the type a setting's text converts to; ``object``: taken
#: as given (``encryption`` is a "env:VAR" / "file:PATH" string or a KeyProvider object).
_ANNOTATION_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str, "Any": object}


def _option_type(annotation: object) -> type:
    text = str(annotation).removesuffix(" | None")
    if text not in _ANNOTATION_TYPES:
        raise TypeError(f"CheckpointOptions has a field of type {annotation!r} this adapter cannot read from text")
    return _ANNOTATION_TYPES[text]


_OPTION_TYPES: dict[str, type] = {f.name: _option_type(f.type) for f in fields(CheckpointOptions)}
SETTING_TYPES: dict[str, type] = {**{k: t for k, (t, _) in ADAPTER_SETTINGS.items()}, **_OPTION_TYPES}


def accelerate_config_dir() -> Path:
    """The folder of Accelerate's default config file (same rule as ``accelerate config``)."""
    hf_home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(os.path.expanduser(hf_home)) / "accelerate"


def config_file_path() -> Path:
    """``$SHARDKEEPER_CONFIG_FILE`` if set, else ``shardkeeper.yaml`` beside Accelerate's config."""
    explicit = os.environ.get(CONFIG_FILE_ENV)
    return Path(os.path.expanduser(explicit)) if explicit else accelerate_config_dir() / CONFIG_FILE_NAME


def _convert(name: str, value: Any, source: str) -> Any:
    kind = SETTING_TYPES[name]
    if value is None:
        return None
    if kind is object:
        return value
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if kind is dict:
            out = json.loads(value) if isinstance(value, str) else value
            if not isinstance(out, Mapping):
                raise ValueError("expected a mapping (JSON object)")
            return dict(out)
        if kind is int and isinstance(value, float):
            raise ValueError("expected an integer")
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"shardkeeper setting {name!r} from {source} is {value!r}, not a valid {kind.__name__} ({e})"
        ) from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in ``path`` (YAML mapping); empty if the file does not exist."""
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"shardkeeper config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"shardkeeper config file {path} must hold a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SETTING_TYPES))
    if unknown:
        raise ValueError(
            f"shardkeeper config file {path}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(SETTING_TYPES))}"
        )
    return {k: _convert(k, v, f"config file {path}") for k, v in data.items()}


def read_env() -> dict[str, Any]:
    """Settings from ``SHARDKEEPER_<NAME>`` variables (``SHARDKEEPER_ASYNC_SAVE=0``, ...)."""
    out = {}
    for name in SETTING_TYPES:
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            out[name] = _convert(name, raw, f"${ENV_PREFIX}{name.upper()}")
    return out


def resolve_settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Merge the sources, highest first: ``arguments`` (None = unset) > env > file > defaults."""
    unknown = sorted(set(arguments) - set(SETTING_TYPES))
    if unknown:
        raise TypeError(
            f"unknown shardkeeper.accelerate option(s): {', '.join(unknown)}; known: {', '.join(sorted(SETTING_TYPES))}"
        )
    merged: dict[str, Any] = {k: d for k, (_, d) in ADAPTER_SETTINGS.items()}
    merged.update(read_config_file(config_file_path()))
    merged.update(read_env())
    merged.update({k: _convert(k, v, "the argument") for k, v in arguments.items() if v is not None})
    return merged


def split_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter settings, CheckpointOptions overrides)."""
    adapter = {k: settings.get(k) for k in ADAPTER_SETTINGS}
    options = {k: v for k, v in settings.items() if k in _OPTION_TYPES}
    return adapter, options
