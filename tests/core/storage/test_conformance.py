"""The shipped conformance suite judges a backend written elsewhere: a minimal in-memory store,
written here as a third party would, passes it in one line, and the same store with a
``put_if_absent`` that overwrites fails it, each failure naming the rule it broke."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardkeeper.core.errors import CheckpointNotFoundError, CommitConflictError, StorageError
from shardkeeper.core.storage import Capabilities
from shardkeeper.core.testing.storage_conformance import StorageConformance

REPO = Path(__file__).resolve().parents[3]


class DictStorage:
    """A whole storage backend in one dict of ``path -> (bytes, mtime)``, behind one lock."""

    capabilities = Capabilities(atomic_put_if_absent=True, ranged_read=True, durable_writes=False, directories=False)

    def __init__(self, files: dict[str, tuple[bytes, float]] | None = None, lock: threading.Lock | None = None) -> None:
        self.url = "dict://test"
        self.files = {} if files is None else files
        self.lock = threading.Lock() if lock is None else lock

    def describe(self, path: str) -> str:
        return f"{self.url}/{path}"

    def _get(self, path: str) -> bytes:
        with self.lock:
            try:
                return self.files[path][0]
            except KeyError as e:
                raise CheckpointNotFoundError(f"{self.describe(path)} does not exist") from e

    def _conflict(self, path: str) -> CommitConflictError:
        err = CommitConflictError(f"{self.describe(path)} already exists")
        err.__cause__ = FileExistsError(path)
        return err

    def list_dir(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        with self.lock:
            return sorted({k[len(prefix) :].split("/", 1)[0] for k in self.files if k.startswith(prefix)})

    def exists(self, path: str) -> bool:
        with self.lock:
            return path in self.files or any(k.startswith(f"{path}/") for k in self.files)

    def size(self, path: str) -> int:
        return len(self._get(path))

    def mtime(self, path: str) -> float:
        self._get(path)
        return self.files[path][1]

    def read_bytes(self, path: str) -> bytes:
        return self._get(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        data = self._get(path)
        if offset + length > len(data):
            raise StorageError(f"{self.describe(path)}: [{offset}, {offset + length}) ends past {len(data)} bytes")
        return data[offset : offset + length]

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        buffer.cast("B")[:] = self.read_range(path, offset, buffer.nbytes)

    def open_writer(self, path: str) -> _Writer:
        if self.exists(path):
            raise self._conflict(path)
        return _Writer(self, path)

    def sync_dir(self, path: str) -> None:
        pass

    def put_if_absent(self, path: str, data: bytes) -> None:
        with self.lock:
            if path in self.files:
                raise self._conflict(path)
            self.files[path] = (bytes(data), time.time())

    def put(self, path: str, data: bytes) -> None:
        with self.lock:
            self.files[path] = (bytes(data), time.time())

    def delete(self, path: str) -> None:
        with self.lock:
            self.files.pop(path, None)

    def delete_dir(self, path: str) -> None:
        if not path:
            raise StorageError(f"refusing to delete the root {self.url}")
        with self.lock:
            for k in [k for k in self.files if k.startswith(f"{path}/")]:
                del self.files[k]


class _Writer:
    def __init__(self, storage: DictStorage, path: str) -> None:
        self.storage, self.path = storage, path
        self.parts: list[bytes] = []

    def write(self, data: memoryview | bytes) -> None:
        self.parts.append(bytes(data))

    def close(self) -> None:
        self.storage.put(self.path, b"".join(self.parts))

    def abort(self) -> None:
        self.parts.clear()


class OverwritingStorage(DictStorage):
    """Broken: ``put_if_absent`` replaces what is there, as a plain PUT would."""

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.put(path, data)


class TestDictStorage(StorageConformance):
    def make_storage(self, tmp_path: Path) -> DictStorage:
        return DictStorage()

    def open_again(self, storage: DictStorage) -> DictStorage:  # type: ignore[override]
        return DictStorage(storage.files, storage.lock)  # another client of the same store, no cache


def test_a_put_if_absent_that_overwrites_fails_the_suite_naming_the_rule(tmp_path: Path) -> None:
    module = tmp_path / "test_third_party_store.py"
    module.write_text(
        "from shardkeeper.core.testing.storage_conformance import StorageConformance\n"
        "from tests.core.storage.test_conformance import OverwritingStorage\n\n\n"
        "class TestOverwriting(StorageConformance):\n"
        "    def make_storage(self, tmp_path):\n"
        "        return OverwritingStorage()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(module),
        "-q",
        "-rfs",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    n = sum(name.startswith("test_") for name in dir(StorageConformance))
    assert proc.returncode == 1 and f"2 failed, {n - 3} passed, 1 skipped" in out, out[-6000:]
    # pytest appends " - <reason>" to a FAILED line when the terminal is wide enough: take the test name only
    failed = sorted(m.group(1) for m in re.finditer(r"^FAILED \S+::(\w+)", out, re.MULTILINE))
    assert failed == ["test_put_if_absent_concurrent_exactly_one_wins", "test_put_if_absent_twice_conflicts"], out
    assert (
        "dict://test: put_if_absent('step-1/manifest.json') over an existing file returned; the protocol wants "
        "it to raise CommitConflictError"
    ) in out, out[-6000:]
    assert "dict://test: 8 threads racing put_if_absent('step-7/manifest.json'): 8 won, exactly one must" in out, out
    assert "open_again() gives no second client" in out, out[-6000:]


def test_only_the_suite_imports_pytest() -> None:
    code = (
        "import sys, shardkeeper.core, shardkeeper.core.storage, shardkeeper.core.testing, "
        "shardkeeper.core.testing.campaign; sys.exit('pytest' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
