"""The etcd catalog: a real etcd (Debian's etcd-server package, fetched and started on
loopback by the fixture), commits recorded through the manager, compare-and-swap on the
latest step under racing writers, and a catalog that is down, or answers JSON of another
shape (a loopback HTTP server of the test's), never failing a save, and one that drips its
answer, loops or answers without end, delaying a save by the catalog's deadline at most."""

from __future__ import annotations

import base64
import http.server
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CatalogError, CheckpointManager, metrics
from shardkeeper.core.commit import catalog as catalog_module
from shardkeeper.core.commit.catalog import DEFAULT_TIMEOUT_S, MAX_ANSWER_BYTES, EtcdCatalog, open_catalog

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
        if callable(body):  # an answer that writes itself (slowly, or without end)
            try:
                body(self)
            except OSError:  # the client gave up and closed
                pass
            return
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


def _headers(h: http.server.BaseHTTPRequestHandler) -> None:
    """A 200 whose body ends when the connection closes (no length: the client reads on)."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Connection", "close")
    h.end_headers()
    h.wfile.flush()


def _drip(h: http.server.BaseHTTPRequestHandler) -> None:
    """The reviewer's endpoint, faster: a valid answer, one byte every 0.2 s for 8 s. Each
    read gets a byte well within any per-read timeout; only a deadline for the call ends it."""
    _headers(h)
    for c in b'{"kvs": []}'.ljust(40):
        h.wfile.write(bytes([c]))
        h.wfile.flush()
        time.sleep(0.2)


def _slow_refusal(h: http.server.BaseHTTPRequestHandler) -> None:
    """A transaction that fails its compare after 0.3 s, every time: each call is quick
    enough, but the compare-and-swap loop retries ``max_retries`` (20) times."""
    time.sleep(0.3)
    _headers(h)
    h.wfile.write(b'{"succeeded": false}')


#: Seconds a catalog call, and the catalog work after a commit, may take in these tests
#: (``?timeout=``), and what a loaded machine may add to a save around it (less than the
#: deadline: a save that waited for it twice, once to record and once to forget, is late).
DEADLINE, MARGIN = 1.5, 1.2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("answers", "said"),
    [
        (
            {"kv/range": _drip, "kv/deleterange": _drip},
            rf"kv/range gave no complete answer within its deadline \({DEADLINE:g} s",
        ),
        (
            {"kv/range": b"{}", "kv/txn": _slow_refusal, "kv/deleterange": _drip},
            rf"kv/(txn|range) \S.* deadline .*\({DEADLINE:g} s",
        ),
    ],
    ids=["dripping answer", "slow compare-and-swap loop"],
)
def test_a_slow_catalog_delays_a_save_by_its_deadline_at_most(
    gateway: http.server.ThreadingHTTPServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    answers: dict[str, Any],
    said: str,
) -> None:
    """One deadline for a whole call (connect to last byte), and one for all the catalog work
    after a commit (recording it, then forgetting the step retention deletes): wait() returns
    within it, the warnings say what happened, the metric counts both (before: a read
    timeout that each dripped byte renewed, 20 retries of 0.3 s, and a deadline of its own
    for the deletion)."""
    gateway.answers.update(answers)  # type: ignore[attr-defined]
    url = f"etcd://127.0.0.1:{gateway.server_address[1]}/jobs?timeout={DEADLINE:g}"
    failures = metrics.AFTER_COMMIT_ERRORS
    before = failures.value(what="catalog"), failures.value(what="catalog_forget")
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "r", catalog=url, keep_last=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        t0 = time.monotonic()
        mgr.save(2, {"w": torch.ones(2)}).wait()  # records step 2, retention deletes step 1
        took = time.monotonic() - t0
        assert mgr.steps() == [2]
    assert took < DEADLINE + MARGIN, f"wait() took {took:.1f} s"
    assert (failures.value(what="catalog"), failures.value(what="catalog_forget")) == (before[0] + 2, before[1] + 1)
    warned = [r.getMessage() for r in caplog.records if "catalog was not updated" in r.getMessage()]
    assert len(warned) == 2 and "127.0.0.1" in warned[1] and re.search(said, warned[1]), warned
    forgot = [r.getMessage() for r in caplog.records if "the catalog still lists them" in r.getMessage()]
    assert len(forgot) == 1 and "past the deadline of this update" in forgot[0], forgot


def _huge(h: http.server.BaseHTTPRequestHandler) -> None:
    """The reviewer's endpoint, smaller: 64 MiB of well-formed key-values."""
    _headers(h)
    kv = b'{"key":"eA==","value":"eA==","mod_revision":"1"},'
    h.wfile.write(b'{"kvs": [')
    block = kv * ((1 << 20) // len(kv))
    for _ in range(64):
        h.wfile.write(block)
    h.wfile.write(kv[:-1] + b"]}")


@pytest.mark.timeout(60)
def test_a_huge_answer_is_refused_without_reading_it(
    gateway: http.server.ThreadingHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer past ``MAX_ANSWER_BYTES`` (4 MiB) stops the read there: the save's Python
    allocations stay far below the 64 MiB sent (before: all of it, and its JSON, parsed)."""
    gateway.answers["kv/range"] = _huge  # type: ignore[attr-defined]
    url = f"etcd://127.0.0.1:{gateway.server_address[1]}/jobs"
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "r", catalog=url) as mgr:
        tracemalloc.start()
        try:
            mgr.save(1, {"w": torch.ones(2)}, async_save=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert mgr.steps() == [1]
    assert peak < 4 * MAX_ANSWER_BYTES, f"peak {peak >> 20} MiB"
    warned = [r.getMessage() for r in caplog.records if "catalog was not updated" in r.getMessage()]
    assert len(warned) == 1 and f"kv/range answered more than {MAX_ANSWER_BYTES} bytes" in warned[0], warned


def test_the_timeout_is_an_option_of_the_catalog_url(tmp_path: Path) -> None:
    cat = open_catalog("etcd://127.0.0.1:2379/jobs?timeout=0.5")
    assert cat is not None and cat.timeout_s == 0.5 and cat.prefix == "jobs/" and cat.endpoint.endswith(":2379")
    assert open_catalog("etcd://127.0.0.1:2379").timeout_s == DEFAULT_TIMEOUT_S  # type: ignore[union-attr]
    for bad in ("timeout=0", "timeout=-1", "timeout=nan", "timeout=x", "retries=3"):
        with pytest.raises(ValueError, match="the one option is timeout="):
            open_catalog(f"etcd://127.0.0.1:2379/jobs?{bad}")
    with pytest.raises(ValueError, match="timeout="):
        CheckpointManager(tmp_path / "r", catalog="etcd://127.0.0.1:2379?timeout=soon")


def test_steps_are_listed_a_page_at_a_time(etcd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each answer stays small however many steps a run records (pages of ``STEPS_PAGE``)."""
    monkeypatch.setattr(catalog_module, "STEPS_PAGE", 7)
    cat = EtcdCatalog(etcd, prefix="pages/")
    for step in range(1, 24):
        cat.record("s3://b/run", step)
    cat.record("s3://b/run-2", 99)  # a root whose URL extends the first's: not listed with it
    assert sorted(cat.steps("s3://b/run")) == list(range(1, 24))


def test_a_listing_that_never_ends_is_refused(gateway: http.server.ThreadingHTTPServer) -> None:
    """An answer that says "more" and lists a key that does not move the listing forward."""
    stuck = {"kvs": [{"key": base64.b64encode(b"elsewhere/1").decode(), "value": "e30="}], "more": True}
    gateway.answers["kv/range"] = json.dumps(stuck).encode()  # type: ignore[attr-defined]
    with pytest.raises(CatalogError, match="keys under"):
        EtcdCatalog(f"http://127.0.0.1:{gateway.server_address[1]}").steps("s3://b/run")
