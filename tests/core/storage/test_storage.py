"""Every backend of the project (local, memory://, S3 on real moto and SeaweedFS servers, GCS on
fake-gcs-server) through the shipped conformance suite (shardkeeper.core.testing.storage_conformance),
plus what each backend claims beyond it, the S3 and GCS specifics, and fault injection."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    StorageError,
)
from shardkeeper.core.storage import Capabilities, LocalStorage, Storage, open_storage
from shardkeeper.core.storage.fsspec_store import FsspecStorage
from shardkeeper.core.testing.faults import FaultyStorage
from shardkeeper.core.testing.storage_conformance import PAYLOAD, StorageConformance

pytestmark = pytest.mark.timeout(120)

MiB = 2**20


def _rm_memory(s: Any, path: str) -> None:
    try:
        s.fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def _write(storage: Storage, path: str, data: bytes) -> None:
    w = storage.open_writer(path)
    w.write(data)
    w.close()


def _reopen_args(storage: Storage) -> tuple[str, dict[str, Any]]:
    if isinstance(storage, LocalStorage):
        return storage.url, {}
    assert isinstance(storage, FsspecStorage)
    if storage.protocol == "s3":
        # A separate client instance (skip fsspec's instance cache), like another process.
        opts = {
            "client_kwargs": dict(storage.fs.client_kwargs),
            "key": storage.fs.key,
            "secret": storage.fs.secret,
            "skip_instance_cache": True,
        }
        return storage.url, opts
    if storage.protocol in ("gs", "gcs"):
        fs = storage.fs
        return storage.url, {
            "endpoint_url": fs._endpoint,
            "token": "anon",
            "project": fs.project,
            "skip_instance_cache": True,
        }
    return storage.url, {}


# -- conformance: the shipped suite on every backend of the project ----------------------------


class _OurBackend(StorageConformance):
    """The suite, a second client like another process's, and the capabilities each backend claims."""

    expected: Capabilities

    def open_again(self, storage: Storage) -> Storage:
        url, options = _reopen_args(storage)
        return open_storage(url, **options)

    def test_claims_its_capabilities(self, storage: Storage) -> None:
        assert storage.capabilities == self.expected


class TestLocal(_OurBackend):
    expected = Capabilities(atomic_put_if_absent=True, ranged_read=True, durable_writes=True, directories=True)

    def make_storage(self, tmp_path: Path) -> Storage:
        return open_storage(tmp_path / "root")


class TestMemory(_OurBackend):
    # fsspec's memory store: no conditional write, nothing durable
    expected = Capabilities(atomic_put_if_absent=False, ranged_read=True, durable_writes=False, directories=False)

    def make_storage(self, tmp_path: Path) -> Storage:
        return open_storage(f"memory://sk-test-{uuid.uuid4().hex[:12]}/run")

    def discard(self, storage: Storage) -> None:
        _rm_memory(storage, storage.root.rsplit("/", 1)[0])  # type: ignore[attr-defined] # process-global


class _OnServer(_OurBackend):
    """A fresh bucket on a server the session started (the conftest fixture named ``root_fixture``)."""

    root_fixture: str
    expected = Capabilities(
        atomic_put_if_absent=True, ranged_read=True, durable_writes=True, directories=False, remote=True
    )

    @pytest.fixture(autouse=True)
    def _server_root(self, request: pytest.FixtureRequest) -> None:
        self.root = request.getfixturevalue(self.root_fixture)

    def make_storage(self, tmp_path: Path) -> Storage:
        url, options = self.root
        return open_storage(url, **options)


class _S3(_OnServer):
    def test_describes_s3_urls(self, storage: Storage) -> None:
        assert storage.url.startswith("s3://") and storage.describe("a/b") == storage.url + "/a/b"

    def test_an_object_appears_only_when_its_upload_completes(self, storage: Storage) -> None:
        w = storage.open_writer("step-1/data/r0")
        w.write(PAYLOAD)
        assert not storage.exists("step-1/data/r0")
        w.close()
        assert storage.read_bytes("step-1/data/r0") == PAYLOAD


@pytest.mark.s3
class TestS3(_S3):
    root_fixture = "s3_root"


@pytest.mark.s3
class TestSeaweed(_S3):
    root_fixture = "seaweed_root"


@pytest.mark.gcs
class TestGCS(_OnServer):
    root_fixture = "gcs_root"


# -- S3 specifics -----------------------------------------------------------------------------


@pytest.fixture(params=["s3", "seaweed"])
def s3_storage(request: pytest.FixtureRequest) -> FsspecStorage:
    """S3 storage with 5 MiB parts, on moto and on SeaweedFS (which checks signatures)."""
    url, options = request.getfixturevalue(f"{request.param}_root")
    return FsspecStorage(url, part_size_bytes=5 * MiB, **options)


def _open_uploads(storage: FsspecStorage) -> list[Any]:
    bucket = storage.root.split("/", 1)[0]
    return storage.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


@pytest.mark.s3
def test_s3_writer_uses_multipart_upload(s3_storage: FsspecStorage) -> None:
    data = (PAYLOAD * (11 * MiB // len(PAYLOAD) + 1))[: 11 * MiB + 123]
    w = s3_storage.open_writer("step-1/data/big")
    for i in range(0, len(data), 3 * MiB):
        w.write(memoryview(data)[i : i + 3 * MiB])
    assert len(_open_uploads(s3_storage)) == 1  # parts went up while writing
    assert not s3_storage.exists("step-1/data/big")
    w.close()
    assert _open_uploads(s3_storage) == []
    assert s3_storage.size("step-1/data/big") == len(data)
    assert s3_storage.read_range("step-1/data/big", 5 * MiB - 7, 20) == data[5 * MiB - 7 : 5 * MiB + 13]
    info = s3_storage.fs.info(s3_storage._full("step-1/data/big"))
    assert "-" in info["ETag"]  # a multipart ETag: "<md5>-<parts>"


@pytest.mark.s3
def test_s3_abort_discards_the_multipart_upload(s3_storage: FsspecStorage) -> None:
    w = s3_storage.open_writer("step-1/data/torn")
    w.write(b"\0" * (6 * MiB))  # one part uploaded
    assert len(_open_uploads(s3_storage)) == 1
    w.abort()
    assert _open_uploads(s3_storage) == []
    assert not s3_storage.exists("step-1/data/torn")
    with pytest.raises(StorageError):
        w.close()  # a closed-after-abort writer never pretends to have committed


@pytest.mark.s3
def test_s3_part_size_minimum(s3_root: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_root
    with pytest.raises(ValueError):
        FsspecStorage(url, part_size_bytes=MiB, **options)


@pytest.mark.s3
def test_s3_missing_bucket_is_not_found(s3_root: tuple[str, dict[str, Any]]) -> None:
    _, options = s3_root
    s = open_storage(f"s3://sk-no-such-bucket-{uuid.uuid4().hex[:8]}/run", **options)
    assert s.list_dir("") == []
    with pytest.raises(CheckpointNotFoundError) as info:
        s.read_bytes("x")
    assert info.value.__cause__ is not None


@pytest.mark.s3
def test_s3_conditional_write_is_enforced_by_the_server(s3_storage: FsspecStorage) -> None:
    """The precondition is the server's, not a check in our client: a raw conditional PUT fails."""
    s3_storage.put("m", b"1")
    bucket, key = s3_storage._full("m").split("/", 1)
    with pytest.raises(OSError) as info:
        s3_storage.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
    assert isinstance(info.value, FileExistsError) or "PreconditionFailed" in repr(info.value.__cause__)
    assert s3_storage.read_bytes("m") == b"1"


@pytest.mark.s3
def test_seaweed_refuses_a_wrong_secret(seaweed_root: tuple[str, dict[str, Any]]) -> None:
    """SeaweedFS verifies request signatures (moto does not): the wrong secret is refused, so
    the SeaweedFS runs prove that the client signs every request it makes correctly."""
    url, options = seaweed_root
    good = open_storage(url, **{**options, "skip_instance_cache": True})
    good.put("m", b"1")
    bad = open_storage(url, **{**options, "secret": "not-the-secret", "skip_instance_cache": True})
    with pytest.raises(StorageError) as info:
        bad.read_bytes("m")  # a GET: 403 without a body
    assert isinstance(info.value.__cause__, PermissionError)
    with pytest.raises(StorageError) as info:
        bad.put("n", b"2")
    assert "SignatureDoesNotMatch" in repr(info.value.__cause__.__cause__)
    assert not good.exists("n")
    assert good.read_bytes("m") == b"1"


def test_precondition_failures_translate_without_condition_field() -> None:
    """S3-compatible stores may omit the ``Condition`` that makes s3fs raise FileExistsError."""
    botocore = pytest.importorskip("botocore.exceptions")
    s3errors = pytest.importorskip("s3fs.errors")
    s = FsspecStorage("memory://sk-translate")
    for code, status in (("PreconditionFailed", 412), ("SomethingElse", 412)):
        raw = botocore.ClientError(
            {
                "Error": {"Code": code, "Message": "nope"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "PutObject",
        )
        translated = s3errors.translate_boto_error(raw)
        assert not isinstance(translated, FileExistsError)
        err = s._translate("put_if_absent", "m", translated)
        assert isinstance(err, CommitConflictError), (code, err)
    other = s._translate("read", "m", PermissionError(13, "denied"))
    assert type(other) is StorageError and "memory://sk-translate/m" in str(other)
    assert isinstance(s._translate("read", "m", FileNotFoundError("m")), CheckpointNotFoundError)


def _gcs_storage(monkeypatch: pytest.MonkeyPatch, *, zonal: bool) -> Any:
    gcsfs = pytest.importorskip("gcsfs")

    async def is_zonal(self: Any, bucket: str) -> bool:  # no network: the answer is ours
        return zonal

    if hasattr(gcsfs.GCSFileSystem, "_is_zonal_bucket"):
        monkeypatch.setattr(gcsfs.GCSFileSystem, "_is_zonal_bucket", is_zonal)
    return gcsfs, FsspecStorage(f"gs://sk-bucket-{uuid.uuid4().hex[:8]}/run", token="anon")


@pytest.mark.gcs
def test_gcs_conditional_write_is_enforced_by_the_server(gcs_root: tuple[str, dict[str, Any]]) -> None:
    """Against a real GCS server (fake-gcs-server): the second put_if_absent is refused by the
    server's ifGenerationMatch=0 check, and the first object stays."""
    url, options = gcs_root
    s = open_storage(url, **options)
    s.put_if_absent("step-000000000001/manifest.json", b"first")
    other = open_storage(url, **options)  # a second client: no shared cache can answer for it
    with pytest.raises(CommitConflictError):
        other.put_if_absent("step-000000000001/manifest.json", b"second")
    assert s.read_bytes("step-000000000001/manifest.json") == b"first"


def test_gcs_put_if_absent_sends_if_generation_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs' one-shot upload (small manifests) carries ifGenerationMatch=0; 412 -> conflict."""
    gcsfs, s = _gcs_storage(monkeypatch, zonal=False)
    calls: list[dict[str, Any]] = []

    async def fake_call(self: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append({"method": method, "path": path, **kwargs})
        if len(calls) > 1:
            from gcsfs.retry import validate_response

            validate_response(412, b'{"error": {"message": "precondition"}}', path)
        return {"name": "run/m", "size": "3", "generation": "1"}

    monkeypatch.setattr(gcsfs.GCSFileSystem, "_call", fake_call)
    assert s.capabilities.atomic_put_if_absent and not s.capabilities.directories
    s.put_if_absent("m", b"abc")
    assert calls[0]["uploadType"] == "multipart" and calls[0]["ifGenerationMatch"] == "0"
    with pytest.raises(CommitConflictError) as info:
        s.put_if_absent("m", b"abc")
    assert isinstance(info.value.__cause__, FileExistsError)


def test_gcs_zonal_bucket_is_not_atomic(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs overwrites on zonal buckets whatever the mode: we must not claim atomicity there."""
    gcsfs, s = _gcs_storage(monkeypatch, zonal=True)
    if not hasattr(gcsfs.GCSFileSystem, "_is_zonal_bucket"):
        pytest.skip("this gcsfs has no zonal-bucket support")
    assert not s.capabilities.atomic_put_if_absent
    puts: list[dict[str, Any]] = []
    monkeypatch.setattr(s.fs, "info", lambda path, **kw: {"name": path, "size": 1, "type": "file"})
    monkeypatch.setattr(s.fs, "pipe_file", lambda path, data, **kw: puts.append(kw))
    with pytest.raises(CommitConflictError):
        s.put_if_absent("m", b"abc")  # exists: refused without writing
    assert puts == []


def test_fsspec_store_does_not_import_torch() -> None:
    code = (
        "import sys, shardkeeper.core.storage.fsspec_store, shardkeeper.core.testing.faults; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_storage_root_fixture(storage_root: Any) -> None:
    url, options = storage_root
    s = open_storage(url, **options)
    s.put_if_absent("a", b"1")
    assert storage_root.open().read_bytes("a") == b"1"


# -- FaultyStorage ---------------------------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield open_storage(tmp_path / "root")
    else:
        s = open_storage(f"memory://sk-faults-{uuid.uuid4().hex[:12]}")
        yield s
        _rm_memory(s, s.root)


def test_faulty_is_a_storage_and_passes_through(inner: Storage) -> None:
    f = FaultyStorage(inner)
    assert isinstance(f, Storage)
    assert f.url == inner.url and f.capabilities == inner.capabilities
    assert f.describe("x") == inner.describe("x")
    _write(f, "d/a", b"abc")
    f.put_if_absent("d/m", b"m")
    assert f.list_dir("d") == ["a", "m"] and f.read_bytes("d/a") == b"abc" and f.size("d/a") == 3
    assert f.injected == []


def test_faulty_fails_named_ops_on_matching_paths(inner: Storage) -> None:
    f = FaultyStorage(
        inner,
        fail_on={"open_writer": "*/data/r00001-*", "put_if_absent": "*/manifest.json"},
    )
    _write(f, "step-1/data/r00000-a-000.safetensors", b"ok")
    with pytest.raises(StorageError) as info:
        f.open_writer("step-1/data/r00001-a-000.safetensors")
    err = info.value
    assert type(err) is StorageError and isinstance(err, OSError)
    assert isinstance(err.__cause__, OSError) and "injected" in str(err.__cause__)
    assert "open_writer" in str(err) and inner.describe("step-1/data/r00001-a-000.safetensors") in str(err)
    with pytest.raises(StorageError):
        f.put_if_absent("step-1/manifest.json", b"{}")
    assert not inner.exists("step-1/manifest.json")
    f.put_if_absent("step-1/other.json", b"{}")  # other paths are untouched
    assert f.injected == [
        ("open_writer", "step-1/data/r00001-a-000.safetensors"),
        ("put_if_absent", "step-1/manifest.json"),
    ]


def test_faulty_error_kinds_translate_like_backends(inner: Storage) -> None:
    inner.put("x", b"1")
    f = FaultyStorage(inner, fail_on={"read_bytes": "x"}, error=FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError) as nf:
        f.read_bytes("x")
    assert isinstance(nf.value.__cause__, FileNotFoundError)
    f = FaultyStorage(inner, fail_on={"put_if_absent": "*"}, error=FileExistsError(17, "exists"))
    with pytest.raises(CommitConflictError) as cc:
        f.put_if_absent("y", b"1")
    assert isinstance(cc.value, FileExistsError) and isinstance(cc.value.__cause__, FileExistsError)
    f = FaultyStorage(inner, fail_on={"size": "*"}, error=lambda op, path: TimeoutError(f"{op} {path} slow"))
    with pytest.raises(StorageError, match="size slow|size x slow") as to:
        f.size("x")
    assert isinstance(to.value.__cause__, TimeoutError)
    # A fresh exception each time, not one instance re-raised with a growing traceback.
    f = FaultyStorage(inner, fail_on={"exists": "*"})
    causes = []
    for _ in range(2):
        with pytest.raises(StorageError) as e:
            f.exists("x")
        causes.append(e.value.__cause__)
    assert causes[0] is not causes[1]


def test_faulty_skip_and_times(inner: Storage) -> None:
    inner.put("x", b"1")
    f = FaultyStorage(inner, fail_on={"read_bytes": "*"}, skip=1, times=2)
    outcomes = []
    for _ in range(5):
        try:
            f.read_bytes("x")
            outcomes.append("ok")
        except StorageError:
            outcomes.append("fail")
    assert outcomes == ["ok", "fail", "fail", "ok", "ok"]
    f2 = FaultyStorage(inner, fail_on={"read_bytes": "*"})
    f2.enabled = False
    assert f2.read_bytes("x") == b"1"


def test_faulty_torn_write_then_abort(inner: Storage) -> None:
    f = FaultyStorage(inner, fail_on={"write": "*/data/*"}, after_bytes=1000)
    w = f.open_writer("step-1/data/r0")
    w.write(PAYLOAD[:600])
    with pytest.raises(StorageError) as info:
        w.write(PAYLOAD[600:1600])  # crosses the limit
    assert "write" in str(info.value) and info.value.__cause__ is not None
    w.abort()
    assert not inner.exists("step-1/data/r0")
    assert f.injected == [("write", "step-1/data/r0")]


def test_faulty_torn_write_passes_exactly_after_bytes(inner: Storage) -> None:
    f = FaultyStorage(inner, fail_on={"write": "*"}, after_bytes=1000, times=1)
    w = f.open_writer("t")
    with pytest.raises(StorageError):
        w.write(PAYLOAD[:1500])
    w.close()  # a caller that closes anyway publishes a torn file: exactly the first 1000 bytes
    assert inner.read_bytes("t") == PAYLOAD[:1000]


def test_faulty_close_failure_leaves_nothing(inner: Storage) -> None:
    f = FaultyStorage(inner, fail_on={"close": "*"})
    w = f.open_writer("c")
    w.write(b"data")
    with pytest.raises(StorageError):
        w.close()
    assert not inner.exists("c")


def test_faulty_torn_put(inner: Storage) -> None:
    f = FaultyStorage(inner, fail_on={"put": "LATEST", "put_if_absent": "*manifest.json"}, after_bytes=3)
    with pytest.raises(StorageError):
        f.put("LATEST", b"12345\n")
    assert inner.read_bytes("LATEST") == b"123"
    with pytest.raises(StorageError):
        f.put_if_absent("s/manifest.json", b'{"format_version": 1}')
    assert inner.read_bytes("s/manifest.json") == b'{"f'


def test_faulty_corrupts_reads(inner: Storage) -> None:
    inner.put("step-1/data/r0", PAYLOAD)
    inner.put("step-1/manifest.json", b"{}")
    f = FaultyStorage(inner, corrupt="*/data/*", corrupt_offset=100)

    def diff(a: bytes, b: bytes) -> list[int]:
        return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]

    assert diff(f.read_bytes("step-1/data/r0"), PAYLOAD) == [100]
    assert diff(f.read_range("step-1/data/r0", 90, 20), PAYLOAD[90:110]) == [10]
    assert f.read_range("step-1/data/r0", 101, 20) == PAYLOAD[101:121]  # does not cover it
    buf = bytearray(50)
    f.read_into("step-1/data/r0", 80, memoryview(buf))
    assert diff(bytes(buf), PAYLOAD[80:130]) == [20]
    assert f.read_bytes("step-1/manifest.json") == b"{}"
    assert inner.read_bytes("step-1/data/r0") == PAYLOAD  # stored bytes untouched

    g = FaultyStorage(inner, corrupt="*/data/*")  # no offset: the first byte of every read
    assert diff(g.read_range("step-1/data/r0", 500, 10), PAYLOAD[500:510]) == [0]


def test_faulty_rejects_unknown_ops(inner: Storage) -> None:
    with pytest.raises(ValueError, match="unknown operation"):
        FaultyStorage(inner, fail_on={"wirte": "*"})


@pytest.mark.s3
def test_faulty_over_s3(s3_root: tuple[str, dict[str, Any]]) -> None:
    """A torn multipart upload under the wrapper: abort leaves neither object nor parts."""
    url, options = s3_root
    s3 = FsspecStorage(url, part_size_bytes=5 * MiB, **options)
    f = FaultyStorage(s3, fail_on={"write": "*"}, after_bytes=6 * MiB)
    w = f.open_writer("step-1/data/r0")
    w.write(b"\1" * (4 * MiB))
    with pytest.raises(StorageError):
        w.write(b"\2" * (4 * MiB))
    w.abort()
    assert not s3.exists("step-1/data/r0")
    assert _open_uploads(s3) == []


@pytest.mark.s3
def test_s3_conditional_writes_can_be_turned_off(s3_root: tuple[str, dict[str, Any]]) -> None:
    """For S3-compatible stores that ignore If-None-Match: check-then-write, and say so."""
    url, options = s3_root
    s = FsspecStorage(url, conditional_writes=False, **options)
    assert not s.capabilities.atomic_put_if_absent
    s.put_if_absent("m", b"1")
    with pytest.raises(CommitConflictError) as info:
        s.put_if_absent("m", b"2")
    assert isinstance(info.value.__cause__, FileExistsError)
    assert s.read_bytes("m") == b"1"
