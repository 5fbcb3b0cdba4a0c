"""Checkpoint metrics: recorded by a real save/restore, read back from a real /metrics endpoint."""

from __future__ import annotations

import logging
import socket
import urllib.request
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def test_save_and_restore_are_served_on_metrics_endpoint(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'shardkeeper-core[metrics]'")
    port = _free_port()
    server = metrics.start_http_server(port, addr="127.0.0.1")
    before_written = metrics.BYTES_WRITTEN.total()
    before_read = metrics.BYTES_READ.total()
    before_saves = metrics.SAVE_SECONDS.total()
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state).wait()
        mgr.save(5, state).wait()
        target = {"w": torch.zeros(1000), "b": torch.zeros(7)}
        assert mgr.restore(target) == 5
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        if isinstance(server, tuple):
            server[0].shutdown()
    assert _sample(text, "checkpoint_last_committed_step") == 5
    assert _sample(text, "checkpoint_bytes_written_total") - before_written >= 2 * 4028
    assert _sample(text, "checkpoint_bytes_read_total") - before_read >= 4028
    assert _sample(text, "checkpoint_save_seconds_count") - before_saves == 2
    assert _sample(text, "checkpoint_stall_seconds_count") >= 2
    assert _sample(text, "checkpoint_restore_seconds_count") >= 1
    assert "# TYPE checkpoint_upload_errors_total counter" in text
    assert 'checkpoint_save_seconds_bucket{le="+Inf"}' in text


def test_metrics_are_structured_log_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="shardkeeper.metrics"):
        with CheckpointManager(tmp_path, async_save=False) as mgr:
            mgr.save(9, {"x": torch.ones(4)})
    recs = {r.metric: r for r in caplog.records if r.name == "shardkeeper.metrics"}  # type: ignore[attr-defined]
    assert set(recs) >= {"checkpoint_bytes_written_total", "checkpoint_last_committed_step", "checkpoint_save_seconds"}
    last = recs["checkpoint_last_committed_step"]
    assert (last.value, last.rank, last.step) == (9, 0, 9)  # type: ignore[attr-defined]


def test_registry_rejects_misuse() -> None:
    reg = metrics.Registry()
    c = reg.metric("c_total", "counter", "c")
    c.inc(2, op="read")
    assert c.value(op="read") == 2 and c.value(op="write") == 0
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        reg.metric("c_total", "gauge", "c")
    h = reg.metric("h", "histogram", "h")
    h.observe(0.02)
    h.observe(1000.0)
    ((_, (cum, count, total)),) = h.samples()
    assert count == 2 and cum[-1] == 2 and cum[0] == 0 and total == pytest.approx(1000.02)
