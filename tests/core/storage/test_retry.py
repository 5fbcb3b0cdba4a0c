"""Transient storage faults are retried with bounded backoff, then fail clearly.

Unit cases run a RetryingStorage over FaultyStorage; the end-to-end cases save and restore
through a byte-level fault proxy (tests/faultproxy.py) in front of a real moto S3 server,
with botocore's and s3fs's own retries off so that every fault reaches shardkeeper's policy.
"""

from __future__ import annotations

import errno
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, metrics
from shardkeeper.core.errors import CheckpointSaveError, CommitConflictError, StorageError
from shardkeeper.core.storage import LocalStorage, open_storage
from shardkeeper.core.storage.retry import RetryingStorage, RetryPolicy
from shardkeeper.core.storage.transient import is_transient
from shardkeeper.core.testing.faults import FaultyStorage
from tests.conftest import s3_storage_options
from tests.faultproxy import FaultProxy

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.005, deadline_s=10.0)
FAST_OPTS = {"retry_max_attempts": 8, "retry_base_delay_s": 0.01, "retry_max_delay_s": 0.05}


def test_transient_read_is_retried_then_succeeds(tmp_path: Path) -> None:
    inner = LocalStorage(tmp_path)
    inner.put("a", b"hello")
    faulty = FaultyStorage(inner, fail_on={"read_bytes": "*"}, error=ConnectionResetError, times=2)
    s = RetryingStorage(faulty, FAST, seed=0)
    before = metrics.UPLOAD_ERRORS.value(op="read_bytes", outcome="retried")
    assert s.read_bytes("a") == b"hello"
    assert s.retries == 2 and s.failures == 0
    assert metrics.UPLOAD_ERRORS.value(op="read_bytes", outcome="retried") == before + 2


def test_persistent_fault_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    inner = LocalStorage(tmp_path)
    faulty = FaultyStorage(inner, fail_on={"put": "*"}, error=TimeoutError)
    s = RetryingStorage(faulty, FAST, seed=0)
    with pytest.raises(StorageError, match=r"put of .*/x failed 4 time\(s\).*retry_max_attempts"):
        s.put("x", b"1")
    assert s.retries == 3 and s.failures == 1


def test_deadline_bounds_the_retries(tmp_path: Path) -> None:
    faulty = FaultyStorage(LocalStorage(tmp_path), fail_on={"list_dir": "*"}, error=ConnectionResetError)
    s = RetryingStorage(faulty, RetryPolicy(max_attempts=1000, base_delay_s=0.05, max_delay_s=0.05, deadline_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="given up"):
        s.list_dir("")
    assert time.monotonic() - t0 < 2.0


def test_non_transient_errors_are_not_retried(tmp_path: Path) -> None:
    faulty = FaultyStorage(LocalStorage(tmp_path), fail_on={"read_bytes": "*"}, error=OSError(errno.EIO, "disk"))
    s = RetryingStorage(faulty, FAST)
    with pytest.raises(StorageError):
        s.read_bytes("a")
    assert s.retries == 0
    assert not is_transient(CommitConflictError("x"))


def test_writer_replays_after_a_transient_write_fault(tmp_path: Path) -> None:
    inner = LocalStorage(tmp_path)
    faulty = FaultyStorage(inner, fail_on={"write": "*"}, error=ConnectionResetError, skip=1, times=1)
    s = RetryingStorage(faulty, FAST)
    w = s.open_writer("d/f")
    w.write(b"abc")
    w.write(memoryview(b"defg"))  # fails once: abort, reopen, replay "abc", write again
    w.close()
    assert inner.read_bytes("d/f") == b"abcdefg" and s.retries == 1


def test_writer_past_the_replay_limit_does_not_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkeeper.core.storage import retry

    monkeypatch.setattr(retry, "MAX_REPLAY_BYTES", 4)
    faulty = FaultyStorage(LocalStorage(tmp_path), fail_on={"write": "*"}, error=ConnectionResetError, skip=1, times=1)
    s = RetryingStorage(faulty, FAST)
    w = s.open_writer("d/f")
    w.write(b"abc")
    with pytest.raises(StorageError):  # 7 bytes would have to be held: the fault goes through
        w.write(b"defg")
    w.abort()
    assert s.retries == 0


def test_put_if_absent_whose_reply_was_lost_counts_as_ours(tmp_path: Path) -> None:
    class LostReply(LocalStorage):
        calls = 0

        def put_if_absent(self, path: str, data: bytes) -> None:
            LostReply.calls += 1
            super().put_if_absent(path, data)
            if LostReply.calls == 1:
                raise StorageError("reply lost") from ConnectionResetError()

    s = RetryingStorage(LostReply(tmp_path), FAST)
    s.put_if_absent("m", b"ours")
    assert LostReply.calls == 2
    LostReply.calls = 0
    with pytest.raises(CommitConflictError):  # someone else's bytes: a real conflict
        RetryingStorage(LostReply(tmp_path), FAST).put_if_absent("m", b"theirs")


# -- end to end through a fault proxy in front of moto ------------------------------------------


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(6)}, "meta": {"seed": seed}}


def _blank() -> dict[str, Any]:
    return {"model": {f"w{i}": torch.zeros(64, 33) for i in range(6)}, "meta": {"seed": -1}}


def _proxied_options(proxy: FaultProxy) -> dict[str, Any]:
    opts = s3_storage_options(proxy.endpoint)
    # botocore's own retries off and short timeouts: every fault reaches shardkeeper's policy.
    opts["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "read_timeout": 1.0, "connect_timeout": 1.0}
    return opts


def _manager(url: str, proxy: FaultProxy, **kw: Any) -> CheckpointManager:
    mgr = CheckpointManager(url, storage_options=_proxied_options(proxy), async_save=False, **FAST_OPTS, **kw)
    mgr.storage.fs.retries = 1  # s3fs's retry loop too (an attribute on this proxy's own instance)
    return mgr


@pytest.fixture
def s3_bucket_url(s3_server: str, s3_fs: Any) -> Any:
    bucket = f"sk-retry-{uuid.uuid4().hex[:12]}"
    s3_fs.mkdir(bucket)
    yield f"s3://{bucket}/run"
    s3_fs.rm(bucket, recursive=True)


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_save_and_restore_through_a_faulty_proxy(s3_server: str, s3_bucket_url: str) -> None:
    with FaultProxy(s3_server, rate=0.25, seed=7, delay_s=1.5) as proxy:
        mgr = _manager(s3_bucket_url, proxy)
        before = metrics.UPLOAD_ERRORS.total()
        for step in (1, 2):
            mgr.save(step, _state(step))
        target = _blank()
        assert mgr.restore(target) == 2
        mgr.close()
    want = _state(2)
    for k, v in want["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert target["meta"] == want["meta"]
    assert sum(proxy.injected.values()) >= 5, proxy.injected
    assert set(proxy.injected) >= {"503", "reset"}, proxy.injected
    assert metrics.UPLOAD_ERRORS.total() - before >= sum(proxy.injected.values()) // 2
    direct = open_storage(s3_bucket_url, **s3_storage_options(s3_server))
    assert CheckpointManager(direct).steps() == [1, 2]


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_persistent_throttling_fails_clearly_and_keeps_the_previous_step(s3_server: str, s3_bucket_url: str) -> None:
    with FaultProxy(s3_server, methods=("PUT", "POST")) as proxy:
        mgr = _manager(s3_bucket_url, proxy)
        mgr.save(1, _state(1))
        proxy.forced = "503"
        before = (
            metrics.UPLOAD_ERRORS.value(op="open_writer", outcome="failed")
            + metrics.UPLOAD_ERRORS.value(op="close", outcome="failed")
            + metrics.UPLOAD_ERRORS.value(op="write", outcome="failed")
        )
        with pytest.raises(CheckpointSaveError, match=r"step 2.*transient errors and was given up"):
            mgr.save(2, _state(2))
        after = (
            metrics.UPLOAD_ERRORS.value(op="open_writer", outcome="failed")
            + metrics.UPLOAD_ERRORS.value(op="close", outcome="failed")
            + metrics.UPLOAD_ERRORS.value(op="write", outcome="failed")
        )
        assert after > before
        assert proxy.injected["503"] >= FAST_OPTS["retry_max_attempts"]
        proxy.forced = None
        assert mgr.steps() == [1]
        target = _blank()
        assert mgr.restore(target) == 1
        mgr.close()
    for k, v in _state(1)["model"].items():
        assert torch.equal(target["model"][k], v), k
