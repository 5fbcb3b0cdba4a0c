"""``export_pretrained``: a committed step as a folder ``from_pretrained`` loads."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from shardkeeper.core import export_safetensors
from shardkeeper.core.adapter import ExportResult, move_in


def export_pretrained(
    root: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    config: Any,
    step: int | None = None,
    **options: Any,
) -> ExportResult:
    """Write step ``step`` of ``root`` (default: the newest committed) to the local folder
    ``to`` as ``save_pretrained`` would: the model's tensors as safetensors shards with their
    index (``model/`` dropped from the names), and ``config`` (a ``PretrainedConfig``, e.g.
    ``trainer.model.config``) as ``config.json``. ``options`` go to
    :func:`shardkeeper.core.export_safetensors` (``max_shard_size``, ``storage_options``,
    ``encryption``, ``overwrite``)."""
    if not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(
            f"export_pretrained: config must be the model's PretrainedConfig (e.g. trainer.model.config), "
            f"not {type(config).__name__}; nothing was written to {os.fspath(to)}"
        )
    result = export_safetensors(root, step, to=to, keys=("model/*",), **options)
    _save_config(config, os.fspath(to))
    return result


def _save_config(config: Any, to: str) -> None:
    """``config.save_pretrained(to)``, without writing through a link planted in ``to``: it
    writes into a fresh private folder (``mkdtemp``: created by this call, mode 0700), whose
    files are then renamed into ``to`` as every export file is (``safe_files.move_in``)."""
    private = tempfile.mkdtemp(prefix=".config-", dir=to)
    try:
        config.save_pretrained(private)
        for name in sorted(os.listdir(private)):
            move_in(os.path.join(private, name), os.path.join(to, name))
    finally:
        shutil.rmtree(private, ignore_errors=True)


__all__ = ["export_pretrained"]
