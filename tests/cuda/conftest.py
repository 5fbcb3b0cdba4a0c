"""The CUDA tests: every test here is marked ``cuda`` and needs a GPU, or the dry run.

``python -m pytest -m cuda tests/cuda`` runs them on ``cuda:0``. Without a GPU each is skipped
with the reason; with ``SHARDKEEPER_CUDA_ON_CPU=1`` they run their logic on the CPU instead
(``tests/cuda/_device.py``), so that a test that is wrong fails here first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cuda._device import SKIP_REASON, runnable, test_device

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok: bool | None = None
    for item in items:
        if HERE not in Path(str(item.path)).parents:
            continue
        if item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)  # every test here is a CUDA test, marked or not
        if ok is None:
            ok = runnable()  # imports torch only once a CUDA test was collected
        if not ok:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture
def device() -> Any:
    """``cuda:0``, or the CPU under ``SHARDKEEPER_CUDA_ON_CPU=1``."""
    return test_device()
