"""The transformers suite: offline (models are built from small configs, nothing is downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
