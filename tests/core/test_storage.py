"""The storage conformance suite (local, memory://, S3 on real moto and SeaweedFS servers, GCS on
fake-gcs-server) and fault injection."""

from __future__ import annotations

import array
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    StorageError,
)
from shardkeeper.core.storage import LocalStorage, Storage, open_storage
from shardkeeper.core.storage.faults import FaultyStorage
from shardkeeper.core.storage.fsspec_store import FsspecStorage

pytestmark = pytest.mark.timeout(120)

MiB = 2**20
PAYLOAD = bytes(range(256)) * 64  # 16 KiB, every byte value, position-dependent


@pytest.fixture(
    params=[
        "local",
        "memory",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("seaweed", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield open_storage(tmp_path / "root")
    elif request.param == "memory":
        url = f"memory://sk-test-{uuid.uuid4().hex[:12]}/run"
        s = open_storage(url)
        yield s
        _rm_memory(s, s.root.rsplit("/", 1)[0])  # the memory store is process-global
    else:
        url, options = request.getfixturevalue(f"{request.param}_root")
        yield open_storage(url, **options)


def _rm_memory(s: Any, path: str) -> None:
    try:
        s.fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def _kind(storage: Storage) -> str:
    if isinstance(storage, LocalStorage):
        return "local"
    assert isinstance(storage, FsspecStorage)
    return storage.protocol


def _write(storage: Storage, path: str, data: bytes) -> None:
    w = storage.open_writer(path)
    w.write(data)
    w.close()


# -- conformance ---------------------------------------------------------------------------------


def test_is_a_storage_and_describes_full_paths(storage: Storage) -> None:
    assert isinstance(storage, Storage)
    assert storage.describe("step-1/manifest.json").endswith("step-1/manifest.json")
    assert storage.describe("step-1/manifest.json").startswith(storage.url)
    if _kind(storage) == "s3":
        assert storage.describe("a/b") == storage.url + "/a/b"
        assert storage.url.startswith("s3://")


def test_capabilities(storage: Storage) -> None:
    caps = storage.capabilities
    assert caps.ranged_read
    kind = _kind(storage)
    if kind == "local":
        assert caps.atomic_put_if_absent and caps.directories and caps.durable_writes
    elif kind in ("s3", "gs", "gcs"):
        assert caps.atomic_put_if_absent and caps.durable_writes and not caps.directories
    else:  # memory: no conditional write, nothing durable
        assert not caps.atomic_put_if_absent and not caps.durable_writes and not caps.directories


def test_list_dir(storage: Storage) -> None:
    assert storage.list_dir("") == []
    assert storage.list_dir("missing") == []
    storage.put("a/x", b"1")
    storage.put("a/y", b"2")
    storage.put("b/c/z", b"3")
    storage.put("top.txt", b"4")
    assert storage.list_dir("") == ["a", "b", "top.txt"]
    assert storage.list_dir("a") == ["x", "y"]
    assert storage.list_dir("b") == ["c"]
    assert storage.list_dir("b/c") == ["z"]
    assert storage.list_dir("top.txt") == []  # a file is not a directory
    assert storage.list_dir("missing") == []
    # Fresh after changes made through the same storage ...
    storage.delete("a/x")
    assert storage.list_dir("a") == ["y"]
    _write(storage, "a/w", b"5")
    assert storage.list_dir("a") == ["w", "y"]


def test_list_dir_sees_writes_by_another_client(storage: Storage) -> None:
    """Other ranks write through their own clients: listings must never be served from a cache."""
    assert storage.list_dir("") == []
    url, options = _reopen_args(storage)
    other = open_storage(url, **options)
    other.put("step-000000000001/manifest.json", b"{}")
    assert storage.list_dir("") == ["step-000000000001"]
    assert storage.list_dir("step-000000000001") == ["manifest.json"]
    other.delete_dir("step-000000000001")
    assert storage.list_dir("") == []
    assert not storage.exists("step-000000000001/manifest.json")


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
        return storage.url, {"endpoint_url": fs._endpoint, "token": "anon", "project": fs.project,
                             "skip_instance_cache": True}
    return storage.url, {}


def test_exists_size_mtime(storage: Storage) -> None:
    before = time.time()
    storage.put("d/f.bin", PAYLOAD)
    assert storage.exists("d/f.bin")
    assert storage.exists("d")  # a directory, or a key prefix on object stores
    assert not storage.exists("d/missing")
    assert not storage.exists("nothing/here")
    assert storage.size("d/f.bin") == len(PAYLOAD)
    # Server clocks (moto's included) and second-granularity timestamps: be generous.
    assert before - 120 <= storage.mtime("d/f.bin") <= time.time() + 120
    with pytest.raises(CheckpointNotFoundError):
        storage.size("d/missing")
    with pytest.raises(CheckpointNotFoundError):
        storage.mtime("d/missing")


def test_read_bytes_range_into(storage: Storage) -> None:
    storage.put("f", PAYLOAD)
    assert storage.read_bytes("f") == PAYLOAD
    assert storage.read_range("f", 0, 10) == PAYLOAD[:10]
    assert storage.read_range("f", 1000, 3000) == PAYLOAD[1000:4000]
    assert storage.read_range("f", len(PAYLOAD) - 5, 5) == PAYLOAD[-5:]
    assert storage.read_range("f", 7, 0) == b""

    buf = bytearray(4096)
    storage.read_into("f", 513, memoryview(buf))
    assert bytes(buf) == PAYLOAD[513 : 513 + 4096]

    # A slice of a larger buffer, filled in place.
    big = bytearray(b"\xaa" * 100)
    storage.read_into("f", 3, memoryview(big)[10:20])
    assert big[:10] == b"\xaa" * 10 and big[10:20] == PAYLOAD[3:13] and big[20:] == b"\xaa" * 80

    # A typed view (e.g. a tensor's storage): filled byte for byte.
    words = array.array("I", [0] * 8)
    storage.read_into("f", 64, memoryview(words))
    assert words.tobytes() == PAYLOAD[64:96]


def test_short_read_is_an_error(storage: Storage) -> None:
    storage.put("f", b"0123456789")
    with pytest.raises(StorageError):
        storage.read_range("f", 5, 10)  # ends past the end of the file
    with pytest.raises(StorageError):
        storage.read_into("f", 8, memoryview(bytearray(4)))


def test_writer_streams_and_appears_on_close(storage: Storage) -> None:
    w = storage.open_writer("step-1/data/r00000-a-000.safetensors")
    w.write(PAYLOAD[:100])
    w.write(memoryview(PAYLOAD)[100:5000])
    w.write(bytearray(PAYLOAD[5000:]))
    if _kind(storage) == "s3":  # an object appears only when its upload completes
        assert not storage.exists("step-1/data/r00000-a-000.safetensors")
    w.close()
    assert storage.exists("step-1/data/r00000-a-000.safetensors")
    assert storage.read_bytes("step-1/data/r00000-a-000.safetensors") == PAYLOAD
    assert storage.list_dir("step-1/data") == ["r00000-a-000.safetensors"]


def test_writer_refuses_an_existing_file(storage: Storage) -> None:
    storage.put("x", b"old")
    with pytest.raises(CommitConflictError) as info:
        storage.open_writer("x")
    assert isinstance(info.value, FileExistsError)
    assert info.value.__cause__ is not None
    assert storage.read_bytes("x") == b"old"


def test_abort_leaves_nothing(storage: Storage) -> None:
    w = storage.open_writer("step-1/data/r00000-a-000.safetensors")
    w.write(PAYLOAD)
    w.abort()
    w.abort()  # idempotent
    assert not storage.exists("step-1/data/r00000-a-000.safetensors")
    assert "r00000-a-000.safetensors" not in storage.list_dir("step-1/data")


def test_put_if_absent_twice_conflicts(storage: Storage) -> None:
    storage.put_if_absent("step-1/manifest.json", b"first")
    with pytest.raises(CommitConflictError) as info:
        storage.put_if_absent("step-1/manifest.json", b"second")
    err = info.value
    assert isinstance(err, FileExistsError) and isinstance(err, CheckpointError)
    assert err.__cause__ is not None
    assert storage.describe("step-1/manifest.json") in str(err)
    assert storage.read_bytes("step-1/manifest.json") == b"first"


def test_put_if_absent_concurrent_exactly_one_wins(storage: Storage) -> None:
    n = 8
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def commit(i: int) -> None:
        barrier.wait()
        try:
            storage.put_if_absent("step-7/manifest.json", f"writer {i}".encode())
            results[i] = "won"
        except BaseException as e:  # noqa: BLE001 - recorded and checked below
            results[i] = e

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, r in enumerate(results) if r == "won"]
    losers = [r for r in results if r != "won"]
    assert len(winners) == 1, results
    assert all(isinstance(r, CommitConflictError) for r in losers), losers
    assert storage.read_bytes("step-7/manifest.json") == f"writer {winners[0]}".encode()


def test_put_overwrites(storage: Storage) -> None:
    storage.put("LATEST", b"100\n")
    storage.put("LATEST", b"200\n")
    assert storage.read_bytes("LATEST") == b"200\n"
    storage.put("deep/er/file", b"x")  # parents are created where they exist
    assert storage.read_bytes("deep/er/file") == b"x"


def test_delete_and_delete_dir_are_idempotent(storage: Storage) -> None:
    storage.put("step-1/data/a", b"a")
    storage.put("step-1/manifest.json", b"m")
    storage.put("step-10/manifest.json", b"m10")  # shares a prefix with step-1
    storage.delete("step-1/data/a")
    storage.delete("step-1/data/a")
    storage.delete("never/existed")
    assert not storage.exists("step-1/data/a")
    storage.delete_dir("step-1")
    storage.delete_dir("step-1")
    storage.delete_dir("never/existed")
    assert not storage.exists("step-1/manifest.json")
    assert storage.list_dir("") == ["step-10"]
    assert storage.read_bytes("step-10/manifest.json") == b"m10"
    with pytest.raises(StorageError):
        storage.delete_dir("")  # never the root


def test_missing_read_is_not_found_with_cause(storage: Storage) -> None:
    for call in (
        lambda: storage.read_bytes("step-1/manifest.json"),
        lambda: storage.read_range("step-1/data/x", 0, 4),
        lambda: storage.read_into("step-1/data/x", 0, memoryview(bytearray(4))),
    ):
        with pytest.raises(CheckpointNotFoundError) as info:
            call()
        err = info.value
        assert isinstance(err, FileNotFoundError) and isinstance(err, CheckpointError)
        assert err.__cause__ is not None
        assert "step-1/" in str(err) and storage.url in str(err)


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
    assert (
        s3_storage.read_range("step-1/data/big", 5 * MiB - 7, 20)
        == data[5 * MiB - 7 : 5 * MiB + 13]
    )
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
    assert isinstance(info.value, FileExistsError) or "PreconditionFailed" in repr(
        info.value.__cause__
    )
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
        "import sys, shardkeeper.core.storage.fsspec_store, shardkeeper.core.storage.faults; "
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
    assert "open_writer" in str(err) and inner.describe(
        "step-1/data/r00001-a-000.safetensors"
    ) in str(err)
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
    f = FaultyStorage(
        inner, fail_on={"size": "*"}, error=lambda op, path: TimeoutError(f"{op} {path} slow")
    )
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
    f = FaultyStorage(
        inner, fail_on={"put": "LATEST", "put_if_absent": "*manifest.json"}, after_bytes=3
    )
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
