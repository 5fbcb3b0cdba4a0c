"""The transformers suite: offline (models are built from small configs, nothing is downloaded),
and the uninterrupted run that several modules compare against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """12 steps uninterrupted, constant LR: its root (steps 4, 8, 12) and its trainer."""
    from tests.transformers.common import CONSTANT, make_trainer

    root = tmp_path_factory.mktemp("ref") / "run"
    trainer = make_trainer(root, **CONSTANT)
    trainer.train()
    return root, trainer
