"""Markers of the Accelerate suite."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped on CPU-only machines")
