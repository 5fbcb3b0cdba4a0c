"""Read ``CheckpointOptions`` settings (and an adapter's own) from outside Python code.

The one reader for every adapter. Sources: a mapping (a framework's config section, a parsed
file), ``SHARDKEEPER_<NAME>`` environment variables, a YAML or JSON file. Each value is
converted to the field's declared type (``options.option_types()``, resolved from the
dataclass), and every error names the source (file, variable, config section), the key and
the expected type. An adapter passes its own keys (a root, retention) as ``extra``: name ->
type, converted by the same rules. The readers return only the settings given, so that a
caller merges its sources by precedence before a manager validates the options as a whole.
Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkeeper.core.config.options import (
    Mismatch,
    conform,
    describe_groups,
    describe_unknown,
    option_types,
    type_name,
)

ENV_PREFIX = "SHARDKEEPER_"


def setting_types(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Name -> declared type of every setting: the options, then ``extra``'s."""
    return {**option_types(), **dict(extra or {})}


def convert_setting(name: str, value: Any, hint: Any, *, source: str) -> Any:
    """``value`` (text, or what YAML/JSON parsed) as of type ``hint``, or a ``ValueError``
    naming the setting, the source, the value and the type."""
    try:
        return conform(value, hint, from_text=True)
    except Mismatch as e:
        what = type_name(hint)
        what = what if what.startswith("one of") else f"a valid {what}"
        raise ValueError(f"shardkeeper setting {name!r} from {source} is {value!r}, not {what} ({e})") from None


def options_from_mapping(
    mapping: Mapping[str, Any], *, source: str, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The settings in ``mapping``, each converted to its type. ``source`` names where they
    came from in errors (``"config file /x.yaml"``, ``"the DeepSpeed config's 'shardkeeper'
    section"``). Unknown keys are a ``ValueError`` listing the close matches."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{source} must be a mapping of settings, got {type(mapping).__name__}")
    known = setting_types(extra)
    unknown = [str(k) for k in mapping if k not in known]
    if unknown:
        others = f"; others: {', '.join(extra)}" if extra else ""
        raise ValueError(
            f"{source}: unknown setting(s) {describe_unknown(unknown, known)}; known, by group: "
            f"{describe_groups()}{others}"
        )
    return {k: convert_setting(k, v, known[k], source=source) for k, v in mapping.items()}


def options_from_env(
    environ: Mapping[str, str] | None = None, *, prefix: str = ENV_PREFIX, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Settings from ``SHARDKEEPER_<NAME>`` variables (``SHARDKEEPER_ASYNC_SAVE=0``); an unset
    or empty variable is not given. ``environ``: default ``os.environ``."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, hint in setting_types(extra).items():
        var = prefix + name.upper()
        raw = env.get(var)
        if raw:
            out[name] = convert_setting(name, raw, hint, source=f"${var}")
    return out


def options_from_file(path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Settings in a file holding one mapping: JSON when it ends in ``.json``, else YAML (needs
    PyYAML). An empty file holds none."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError as e:
            raise ValueError(f"shardkeeper config file {path} is not valid JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError as e:
            raise ImportError(
                f"reading the YAML config file {path} needs PyYAML (pip install pyyaml); "
                f"or write it as JSON (a .json file)"
            ) from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"shardkeeper config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"shardkeeper config file {path} must hold a mapping of settings, got {type(data).__name__}")
    return options_from_mapping(data, source=f"config file {path}", extra=extra)


__all__ = [
    "ENV_PREFIX",
    "convert_setting",
    "options_from_env",
    "options_from_file",
    "options_from_mapping",
    "setting_types",
]
