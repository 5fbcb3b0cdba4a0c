"""The etcd catalog: a real etcd (Debian's etcd-server package, fetched and started on
loopback by the fixture), commits recorded through the manager, compare-and-swap on the
latest step under racing writers, and a catalog that is down, or answers JSON of another
shape (a loopback HTTP server of the test's), never failing a save."""

from __future__ import annotations

import base64
import http.server
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CatalogError, CheckpointManager, metrics
from shardkeeper.core.catalog import EtcdCatalog, open_catalog

pytestmark = [pytest.mark.timeout(180)]

CACHE = Path.home() / ".cache" / "shardkeeper-tests" / "etcd"


def _etcd_binary() -> Path | None:
    found = shutil.which("etcd")
    if found:
        return Path(found)
    binary = CACHE / "usr" / "bin" / "etcd"
    if binary.is_file():
        return binary
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", "etcd-server"], cwd=CACHE, check=True, capture_output=True, timeout=60)
        deb = sorted(CACHE.glob("etcd-server_*.deb"))[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE)], check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError, IndexError):
        return None
    return binary if binary.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed and Debian's etcd-server package could not be fetched (apt-get download)")
    data = tmp_path_factory.mktemp("etcd")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    log = open(data / "etcd.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(binary),
            "--name",
            "sk",
            "--data-dir",
            str(data / "d"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"sk=http://127.0.0.1:{peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"etcd did not start: {(data / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_commits_are_recorded_in_etcd(etcd: str, tmp_path: Path) -> None:
    root = tmp_path / "run"
    cat_url = etcd.replace("http://", "etcd://") + "/jobs"
    with CheckpointManager(root, catalog=cat_url) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((4,), float(step))}).wait()
        url = mgr.storage.url
    cat = open_catalog(cat_url)
    assert cat is not None and cat.prefix == "jobs/"
    assert cat.latest(url) == 20
    steps = cat.steps(url)
    assert sorted(steps) == [10, 20]
    assert steps[20]["world_size"] == 1 and steps[20]["manifest"].endswith("step-000000000020/manifest.json")
    assert steps[20]["size_bytes"] > 0 and steps[20]["created_at"]
    assert EtcdCatalog(etcd).latest(url) is None  # another prefix, another catalog
    # retention and delete() drop the records of the steps they delete; latest stays
    with CheckpointManager(root, catalog=cat_url, keep_last=2) as mgr:
        mgr.save(30, {"w": torch.full((4,), 30.0)}).wait()
        assert sorted(cat.steps(url)) == [20, 30]
        assert mgr.delete(20)
    assert sorted(cat.steps(url)) == [30] and cat.latest(url) == 30


def test_latest_moves_only_forward_under_racing_writers(etcd: str) -> None:
    cat = EtcdCatalog(etcd, prefix="race/")
    assert cat.record("s3://b/run", 5) is True
    assert cat.record("s3://b/run", 3) is False  # an older step is recorded, latest stays
    assert cat.latest("s3://b/run") == 5 and sorted(cat.steps("s3://b/run")) == [3, 5]
    errors: list[BaseException] = []

    def writer(steps: range) -> None:
        try:
            for s in steps:
                EtcdCatalog(etcd, prefix="race/", max_retries=200).record("s3://b/run2", s)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(range(i, 60, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cat.latest("s3://b/run2") == 59
    assert sorted(cat.steps("s3://b/run2")) == list(range(60))


def test_a_catalog_that_is_down_never_fails_a_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = f"etcd://127.0.0.1:{_free_port()}"
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "r", catalog=dead) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, async_save=False)
        assert mgr.steps() == [1]
    assert "catalog was not updated" in caplog.text
    with pytest.raises(CatalogError, match="the manifests are the truth"):
        EtcdCatalog(dead.replace("etcd://", "http://"), timeout_s=1).latest("x")
    with pytest.raises(ValueError, match="etcd endpoint"):
        open_catalog("redis://x")


class _Gateway(http.server.BaseHTTPRequestHandler):
    """An endpoint that answers every ``/v3/<call>`` with ``server.answers[<call>]`` (bytes):
    what a proxy, another service or a gateway of another version may send."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = self.server.answers.get(self.path.removeprefix("/v3/"), b"{}")  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)  # a free port
    server.answers = {}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


_B64_ABC = base64.b64encode(b"abc").decode()
MALFORMED = {  # call -> answer; each one a commit must survive
    "kvs of ints": {"kv/range": b'{"kvs":[1]}'},
    "a list": {"kv/range": b"[1, 2]"},
    "not JSON": {"kv/range": b"<html>502 Bad Gateway</html>"},
    "kvs not a list": {"kv/range": b'{"kvs": {"value": 1}}'},
    "value not base64": {"kv/range": b'{"kvs":[{"value": 5, "mod_revision": "3"}]}'},
    "revision not an int": {"kv/range": b'{"kvs":[{"value": "MQ==", "mod_revision": [3]}]}'},
    "latest not a step": {"kv/range": json.dumps({"kvs": [{"value": _B64_ABC, "mod_revision": "3"}]}).encode()},
    "succeeded not a bool": {"kv/range": b"{}", "kv/txn": b'{"succeeded": "yes"}'},
    "txn a list": {"kv/range": b"{}", "kv/txn": b"[true]"},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_catalog_answering_another_shape_never_fails_a_committed_save(
    gateway: http.server.ThreadingHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """The commit is done once the manifest is put (a retry is refused): whatever the endpoint
    answers, wait() returns, a warning names the step, the metric counts it, the next save works."""
    gateway.answers.update(MALFORMED[case])  # type: ignore[attr-defined]
    url = f"etcd://127.0.0.1:{gateway.server_address[1]}/jobs"
    failures = metrics.AFTER_COMMIT_ERRORS
    before = failures.value(what="catalog")
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "r", catalog=url) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, async_save=True).wait()
        assert mgr.steps() == [1]
        assert failures.value(what="catalog") == before + 1
        mgr.save(2, {"w": torch.full((2,), 2.0)}, async_save=True).wait()
        assert mgr.steps() == [1, 2]
    assert failures.value(what="catalog") == before + 2
    warned = [r.getMessage() for r in caplog.records if "catalog was not updated" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("step 1 committed under ") and "CatalogError" in warned[0]
    with pytest.raises(CatalogError, match=r"127\.0\.0\.1.*(answered|failed|holds)"):
        EtcdCatalog(f"http://127.0.0.1:{gateway.server_address[1]}").record("s3://b/run", 3)
