"""``export_pretrained`` never writes through a link planted in its folder: neither the
shards and index (core export) nor ``config.json`` (written by ``save_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import transformers  # noqa: E402

from shardkeeper.transformers import export_pretrained  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_export_pretrained_replaces_a_planted_config_link_instead_of_writing_through_it(
    tmp_path: Path, reference: tuple[Path, Any]
) -> None:
    root, trainer = reference
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").symlink_to(outside / "victim")  # kept by overwrite=True: not an export file
    export_pretrained(root, out, config=trainer.model.config, step=12, overwrite=True, progress=False)
    assert (outside / "victim").read_bytes() == b"keep" and [p.name for p in outside.iterdir()] == ["victim"]
    assert [p.name for p in out.iterdir() if p.is_symlink() or p.name.startswith(".")] == []
    assert json.loads((out / "config.json").read_text())["model_type"] == trainer.model.config.model_type
    assert (out / "model.safetensors.index.json").is_file()
    assert transformers.AutoConfig.from_pretrained(str(out), local_files_only=True).vocab_size == 64
