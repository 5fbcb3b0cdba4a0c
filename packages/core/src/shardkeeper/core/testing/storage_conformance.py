"""The storage conformance suite: what every ``Storage`` backend must do (needs pytest).

A backend (``shardkeeper.core.storage.base.Storage``) runs every check in one line of its
own test module, as fsspec ships its abstract tests::

    from shardkeeper.core.testing.storage_conformance import StorageConformance

    class TestMyStore(StorageConformance):
        def make_storage(self, tmp_path):
            return MyStore(tmp_path / "root")  # an empty root, fresh for each test

Optional hooks: ``open_again(storage)`` returns a second client on the same root, as another
process would open it (without it, the check that listings are never served from a cache is
skipped); ``discard(storage)`` cleans up after each test. A subclass that needs other fixtures
(a server) takes them in an ``autouse`` fixture of its own, which pytest sets up first.

The checks are the protocol's, independent of any backend: listing, existence, sizes and
times, whole, ranged and in-place reads (short reads are errors), streaming writers that
refuse an existing file and leave nothing when aborted, ``put_if_absent`` that never
replaces (of threads racing on one name exactly one wins, whatever the capabilities claim:
the protocol is thread-safe), ``put`` that replaces, idempotent deletes that never delete
the root, and errors translated to shardkeeper's with the backend's as ``__cause__`` and the
location in the message. Each failure says which operation broke which rule.

This module imports pytest; nothing else in shardkeeper does.
"""

from __future__ import annotations

import array
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    StorageError,
)
from shardkeeper.core.storage.base import Capabilities, Storage

#: 16 KiB holding every byte value, position-dependent: a misplaced byte cannot go unseen.
PAYLOAD = bytes(range(256)) * 64


def _fail(storage: Storage, msg: str) -> NoReturn:
    pytest.fail(f"{getattr(storage, 'url', storage)!s}: {msg}", pytrace=False)


def _require(storage: Storage, ok: object, msg: str) -> None:
    """A check that holds under ``python -O`` too (asserts would vanish)."""
    if not ok:
        _fail(storage, msg)


def _raises(storage: Storage, kind: type[BaseException], call: Callable[[], object], what: str) -> Any:
    """The ``kind`` exception ``call`` raises; a failure naming ``what`` if it raises another or none."""
    try:
        call()
    except kind as e:
        return e
    except Exception as e:  # noqa: BLE001 - the wrong kind is the failure reported
        _fail(storage, f"{what} raised {type(e).__name__}: {e}; the protocol wants {kind.__name__}")
    _fail(storage, f"{what} returned; the protocol wants it to raise {kind.__name__}")


def _write(storage: Storage, path: str, data: bytes) -> None:
    w = storage.open_writer(path)
    w.write(data)
    w.close()


class StorageConformance:
    """Every ``test_*`` method runs against a fresh, empty storage from ``make_storage``."""

    def make_storage(self, tmp_path: Path) -> Storage:
        """An empty storage root for one test (``tmp_path``: pytest's, for local roots)."""
        raise NotImplementedError(f"{type(self).__name__}.make_storage(tmp_path) must return an empty Storage")

    def open_again(self, storage: Storage) -> Storage | None:
        """A second client on ``storage``'s root, sharing no cache with it (None: not checked)."""
        return None

    def discard(self, storage: Storage) -> None:
        """Remove what a test left (after each test); nothing by default."""

    @pytest.fixture
    def storage(self, tmp_path: Path) -> Iterator[Storage]:
        s = self.make_storage(tmp_path)
        _require(
            s,
            isinstance(s, Storage),
            f"make_storage returned {type(s).__name__}, which lacks part of the "
            "Storage protocol (shardkeeper.core.storage.base.Storage: url, capabilities and the operations)",
        )
        try:
            yield s
        finally:
            self.discard(s)

    # -- identity ----------------------------------------------------------------------------

    def test_describes_full_paths_under_its_url(self, storage: Storage) -> None:
        where = storage.describe("step-1/manifest.json")
        _require(
            storage,
            where.startswith(storage.url) and where.endswith("step-1/manifest.json"),
            f"describe('step-1/manifest.json') is {where!r}: messages need the url followed by the path",
        )

    def test_capabilities_are_declared(self, storage: Storage) -> None:
        caps = storage.capabilities
        _require(storage, isinstance(caps, Capabilities), f"capabilities is {caps!r}, not a Capabilities")
        for name in ("atomic_put_if_absent", "ranged_read", "durable_writes", "directories"):
            _require(storage, isinstance(getattr(caps, name), bool), f"capabilities.{name} is not a bool")

    # -- listing and metadata -----------------------------------------------------------------

    def test_list_dir(self, storage: Storage) -> None:
        def listed(path: str, want: list[str], when: str) -> None:
            got = storage.list_dir(path)
            _require(
                storage,
                got == want,
                f"list_dir({path!r}) {when} is {got!r}, want {want!r} (sorted names directly under it)",
            )

        listed("", [], "of an empty root")
        listed("missing", [], "of a missing directory")
        storage.put("a/x", b"1")
        storage.put("a/y", b"2")
        storage.put("b/c/z", b"3")
        storage.put("top.txt", b"4")
        listed("", ["a", "b", "top.txt"], "after four puts")
        listed("a", ["x", "y"], "after four puts")
        listed("b", ["c"], "after four puts")
        listed("b/c", ["z"], "after four puts")
        listed("top.txt", [], "of a file (not a directory)")
        storage.delete("a/x")
        listed("a", ["y"], "after delete('a/x') through the same client (no stale cache)")
        _write(storage, "a/w", b"5")
        listed("a", ["w", "y"], "after a writer closed a/w (no stale cache)")

    def test_list_dir_sees_writes_by_another_client(self, storage: Storage) -> None:
        """Other ranks write through their own clients: listings must never come from a cache."""
        other = self.open_again(storage)
        if other is None:
            pytest.skip(f"{type(self).__name__}.open_again() gives no second client: listing caches not checked")
        _require(storage, storage.list_dir("") == [], "list_dir('') of an empty root is not []")
        other.put("step-000000000001/manifest.json", b"{}")
        got = storage.list_dir("")
        _require(storage, got == ["step-000000000001"], f"list_dir('') after another client's put is {got!r}")
        got = storage.list_dir("step-000000000001")
        _require(
            storage, got == ["manifest.json"], f"list_dir('step-000000000001') after another client's put is {got!r}"
        )
        other.delete_dir("step-000000000001")
        got = storage.list_dir("")
        _require(storage, got == [], f"list_dir('') after another client's delete_dir is {got!r}, want []")
        _require(
            storage,
            not storage.exists("step-000000000001/manifest.json"),
            "exists() is true for a file another client deleted",
        )

    def test_exists_size_mtime(self, storage: Storage) -> None:
        before = time.time()
        storage.put("d/f.bin", PAYLOAD)
        _require(storage, storage.exists("d/f.bin"), "exists() is false for a file just put")
        _require(storage, storage.exists("d"), "exists() is false for the directory (or key prefix) of a file")
        _require(storage, not storage.exists("d/missing"), "exists() is true for a missing file")
        _require(storage, not storage.exists("nothing/here"), "exists() is true under a missing directory")
        size = storage.size("d/f.bin")
        _require(storage, size == len(PAYLOAD), f"size() is {size}, want {len(PAYLOAD)}")
        mtime = storage.mtime("d/f.bin")  # server clocks and second-granularity stamps: generous
        _require(
            storage, before - 120 <= mtime <= time.time() + 120, f"mtime() is {mtime}, not seconds since the epoch now"
        )
        _raises(storage, CheckpointNotFoundError, lambda: storage.size("d/missing"), "size() of a missing file")
        _raises(storage, CheckpointNotFoundError, lambda: storage.mtime("d/missing"), "mtime() of a missing file")

    # -- reads --------------------------------------------------------------------------------

    def test_read_bytes_range_into(self, storage: Storage) -> None:
        storage.put("f", PAYLOAD)
        _require(storage, storage.read_bytes("f") == PAYLOAD, "read_bytes() does not return the bytes put")
        for offset, length in ((0, 10), (1000, 3000), (len(PAYLOAD) - 5, 5), (7, 0)):
            got = storage.read_range("f", offset, length)
            _require(
                storage,
                got == PAYLOAD[offset : offset + length],
                f"read_range('f', {offset}, {length}) returned {len(got)} other bytes",
            )
        buf = bytearray(4096)
        storage.read_into("f", 513, memoryview(buf))
        _require(
            storage,
            bytes(buf) == PAYLOAD[513 : 513 + 4096],
            "read_into() did not fill the buffer with the bytes at the offset",
        )
        big = bytearray(b"\xaa" * 100)  # a slice of a larger buffer, filled in place
        storage.read_into("f", 3, memoryview(big)[10:20])
        _require(
            storage,
            big[:10] == b"\xaa" * 10 and big[10:20] == PAYLOAD[3:13] and big[20:] == b"\xaa" * 80,
            "read_into() of a slice wrote outside the slice or other bytes into it",
        )
        words = array.array("I", [0] * 8)  # a typed view, like a tensor's storage: byte for byte
        storage.read_into("f", 64, memoryview(words))
        _require(
            storage,
            words.tobytes() == PAYLOAD[64:96],
            "read_into() of a typed (non-byte) view did not fill it byte for byte",
        )

    def test_short_read_is_an_error(self, storage: Storage) -> None:
        storage.put("f", b"0123456789")
        _raises(storage, StorageError, lambda: storage.read_range("f", 5, 10), "read_range() past the end of the file")
        _raises(
            storage,
            StorageError,
            lambda: storage.read_into("f", 8, memoryview(bytearray(4))),
            "read_into() past the end of the file",
        )

    def test_missing_read_is_not_found_with_cause(self, storage: Storage) -> None:
        for what, call in (
            ("read_bytes('step-1/manifest.json')", lambda: storage.read_bytes("step-1/manifest.json")),
            ("read_range('step-1/data/x', 0, 4)", lambda: storage.read_range("step-1/data/x", 0, 4)),
            (
                "read_into('step-1/data/x', 0, ...)",
                lambda: storage.read_into("step-1/data/x", 0, memoryview(bytearray(4))),
            ),
        ):
            err = _raises(storage, CheckpointNotFoundError, call, f"{what} of a missing file")
            _require(
                storage,
                isinstance(err, FileNotFoundError) and isinstance(err, CheckpointError),
                f"{what}: CheckpointNotFoundError must stay a FileNotFoundError and a CheckpointError",
            )
            _require(storage, err.__cause__ is not None, f"{what}: the backend's own error is not kept as __cause__")
            _require(
                storage,
                "step-1/" in str(err) and storage.url in str(err),
                f"{what}: the message {str(err)!r} does not name the location (url and path)",
            )

    # -- writes -------------------------------------------------------------------------------

    def test_writer_streams_and_appears_on_close(self, storage: Storage) -> None:
        path = "step-1/data/r00000-a-000.safetensors"
        w = storage.open_writer(path)
        w.write(PAYLOAD[:100])
        w.write(memoryview(PAYLOAD)[100:5000])
        w.write(bytearray(PAYLOAD[5000:]))  # type: ignore[arg-type] # a bytearray too
        w.close()
        _require(storage, storage.exists(path), "a closed writer's file does not exist")
        _require(
            storage,
            storage.read_bytes(path) == PAYLOAD,
            "a writer fed bytes, a memoryview and a bytearray did not store them in order",
        )
        got = storage.list_dir("step-1/data")
        _require(
            storage, got == ["r00000-a-000.safetensors"], f"list_dir('step-1/data') after the writer closed is {got!r}"
        )

    def test_writer_refuses_an_existing_file(self, storage: Storage) -> None:
        storage.put("x", b"old")
        err = _raises(
            storage, CommitConflictError, lambda: storage.open_writer("x"), "open_writer() of an existing file"
        )
        _require(storage, isinstance(err, FileExistsError), "CommitConflictError must stay a FileExistsError")
        _require(storage, err.__cause__ is not None, "open_writer(): the backend's own error is not kept as __cause__")
        _require(storage, storage.read_bytes("x") == b"old", "open_writer() of an existing file changed it")

    def test_abort_leaves_nothing(self, storage: Storage) -> None:
        path = "step-1/data/r00000-a-000.safetensors"
        w = storage.open_writer(path)
        w.write(PAYLOAD)
        w.abort()
        w.abort()  # idempotent
        _require(storage, not storage.exists(path), "an aborted writer's file exists")
        _require(
            storage,
            "r00000-a-000.safetensors" not in storage.list_dir("step-1/data"),
            "an aborted writer's file is listed",
        )

    def test_put_if_absent_twice_conflicts(self, storage: Storage) -> None:
        path = "step-1/manifest.json"
        storage.put_if_absent(path, b"first")
        err = _raises(
            storage,
            CommitConflictError,
            lambda: storage.put_if_absent(path, b"second"),
            f"put_if_absent({path!r}) over an existing file",
        )
        _require(
            storage,
            isinstance(err, FileExistsError) and isinstance(err, CheckpointError),
            "CommitConflictError must stay a FileExistsError and a CheckpointError",
        )
        _require(
            storage, err.__cause__ is not None, "put_if_absent(): the backend's own error is not kept as __cause__"
        )
        _require(
            storage,
            storage.describe(path) in str(err),
            f"the conflict {str(err)!r} does not name {storage.describe(path)}",
        )
        kept = storage.read_bytes(path)
        _require(
            storage,
            kept == b"first",
            f"put_if_absent({path!r}) replaced the first writer's bytes "
            f"(now {kept!r}): a commit must never overwrite another",
        )

    def test_put_if_absent_concurrent_exactly_one_wins(self, storage: Storage) -> None:
        n, path = 8, "step-7/manifest.json"
        barrier = threading.Barrier(n)
        results: list[object] = [None] * n

        def commit(i: int) -> None:
            barrier.wait()
            try:
                storage.put_if_absent(path, f"writer {i}".encode())
                results[i] = "won"
            except BaseException as e:  # noqa: BLE001 - recorded and judged below
                results[i] = e

        threads = [threading.Thread(target=commit, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [i for i, r in enumerate(results) if r == "won"]
        losers = [r for r in results if r != "won"]
        _require(
            storage,
            len(winners) == 1,
            f"{n} threads racing put_if_absent({path!r}): {len(winners)} won, exactly one must ({results!r})",
        )
        _require(
            storage,
            all(isinstance(r, CommitConflictError) for r in losers),
            f"the losers of the put_if_absent race must raise CommitConflictError: {losers!r}",
        )
        kept = storage.read_bytes(path)
        _require(storage, kept == f"writer {winners[0]}".encode(), f"the stored bytes {kept!r} are not the winner's")

    def test_put_overwrites(self, storage: Storage) -> None:
        storage.put("LATEST", b"100\n")
        storage.put("LATEST", b"200\n")
        got = storage.read_bytes("LATEST")
        _require(storage, got == b"200\n", f"put() over an existing file left {got!r}, want the new bytes")
        storage.put("deep/er/file", b"x")
        _require(storage, storage.read_bytes("deep/er/file") == b"x", "put() did not create the parent directories")

    # -- deletes ------------------------------------------------------------------------------

    def test_delete_and_delete_dir_are_idempotent(self, storage: Storage) -> None:
        storage.put("step-1/data/a", b"a")
        storage.put("step-1/manifest.json", b"m")
        storage.put("step-10/manifest.json", b"m10")  # shares a prefix with step-1
        for _ in range(2):
            storage.delete("step-1/data/a")
        storage.delete("never/existed")
        _require(storage, not storage.exists("step-1/data/a"), "delete() left the file")
        for _ in range(2):
            storage.delete_dir("step-1")
        storage.delete_dir("never/existed")
        _require(storage, not storage.exists("step-1/manifest.json"), "delete_dir('step-1') left a file under it")
        got = storage.list_dir("")
        _require(
            storage,
            got == ["step-10"],
            f"after delete_dir('step-1') the root lists {got!r}: a name sharing its prefix (step-10) must stay",
        )
        _require(storage, storage.read_bytes("step-10/manifest.json") == b"m10", "delete_dir('step-1') touched step-10")
        _raises(storage, StorageError, lambda: storage.delete_dir(""), "delete_dir('') (the root itself)")


__all__ = ["StorageConformance"]
