"""The CLI's first-hour details: --version, verify -v, a missing extra named with its pip line,
and a store that does not answer announced on stderr instead of silence."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkeeper.core.cli import main
from shardkeeper.core.format.features import FORMAT_VERSION
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.storage.retry import RetryingStorage, RetryPolicy, wait_log
from shardkeeper.core.util.version import shardkeeper_version

try:
    from .._builders import run_cli as run
    from .._builders import tensor, write_step
except ImportError:
    from _builders import run_cli as run
    from _builders import tensor, write_step

pytestmark = pytest.mark.timeout(120)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and err == ""
    assert out == f"shardkeeper {shardkeeper_version()} (checkpoint format {FORMAT_VERSION})\n"
    p = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.cli", "--version"], capture_output=True, text=True, env=_env()
    )
    assert p.returncode == 0 and p.stdout.startswith("shardkeeper ") and str(FORMAT_VERSION) in p.stdout


def test_verify_verbose_prints_each_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    storage = LocalStorage(root, fsync=False)
    write_step(storage, 10, {"model/w": tensor("float32", (64, 16), 1)})
    m = write_step(storage, 20, {"model/w": tensor("float32", (64, 16), 2)})
    code, out, err = run(capsys, "verify", root)
    assert code == 0 and "INFO" not in err  # without -v: the summary on stdout only
    code, out, err = run(capsys, "verify", root, "-v")
    assert code == 0
    lines = [line for line in err.splitlines() if ": OK: " in line]
    assert len(lines) == 2, err
    assert re.search(r"step 10: OK: 1 files, 1 chunks, 4\.0 KiB checked in \d+\.\d\d s", lines[0]), lines[0]
    assert "step 20: OK" in lines[1]
    assert re.search(r"step 20: OK \(1 files, 1 chunks, 4\.0 KiB checked in \d+\.\d\d s\)", out)

    # A damaged step: named, with its problem, in the -v line.
    c = m.leaves["model/w"].chunks[0]
    shard = root / step_dir(20) / c.file
    data = bytearray(shard.read_bytes())
    data[c.offset + 10] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", root, "-v")
    assert code == 1
    bad = [line for line in err.splitlines() if "DAMAGED" in line]
    assert len(bad) == 1 and "step 20: DAMAGED: 1 problem(s) in" in bad[0] and "digest mismatch" in bad[0]
    assert any("step 10: OK: " in line for line in err.splitlines())


def _without(blocked: tuple[str, ...], argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``shardkeeper ARGV`` in a process where the modules ``blocked`` cannot be imported."""
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # unimportable, as on a torch-free install\n"
        "from shardkeeper.core.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=100)


@pytest.mark.parametrize(
    ("command", "blocked", "install"),
    [
        (["export", "{root}", "--to", "{out}"], "numpy", "pip install numpy (or 'shardkeeper-core[torch]')"),
        (["verify", "{root}"], "numpy", "pip install numpy (or 'shardkeeper-core[torch]')"),
        (
            ["import", "{out}", "{root}", "--step", "3", "--trust-pickle"],
            "torch",
            "pip install 'shardkeeper-core[torch]'",
        ),
    ],
    ids=["export-without-numpy", "verify-without-numpy", "import-without-torch"],
)
def test_a_missing_extra_is_named(tmp_path: Path, command: list[str], blocked: str, install: str) -> None:
    root = tmp_path / "run"
    write_step(LocalStorage(root, fsync=False), 1, {"model/w": tensor("float32", (4, 4))})
    p = _without((blocked,), [a.format(root=root, out=tmp_path / "out") for a in command])
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr == f"shardkeeper: error: shardkeeper {command[0]} needs {blocked}: {install}\n"


def test_what_needs_neither_numpy_nor_torch_runs_without(tmp_path: Path) -> None:
    """ls, inspect, gc and advise on an install with neither (numpy is not a core dependency)."""
    root = tmp_path / "run"
    write_step(LocalStorage(root, fsync=False), 1, {"model/w": tensor("float32", (4, 4))})
    for argv in (["ls"], ["inspect"], ["gc", "--dry-run"], ["advise", "--mtbf", "3h", "--cost", "1m"]):
        p = _without(("numpy", "torch"), [argv[0], str(root), *argv[1:]])
        assert p.returncode == 0 and p.stderr == "", (argv, p.stderr)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # nothing listens there now: connections are refused
    return port


def test_an_unreachable_store_says_what_it_waits_for() -> None:
    pytest.importorskip("s3fs")
    port = _closed_port()
    argv = [
        sys.executable, "-m", "shardkeeper.core.cli", "ls", "s3://bucket/run",
        "-o", f"endpoint_url=http://127.0.0.1:{port}",
        "-o", "retry_max_attempts=3", "-o", "retry_base_delay_s=0.05",
    ]  # fmt: skip
    env = _env(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_EC2_METADATA_DISABLED="true")
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=100)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    want = (
        f"shardkeeper: waiting for s3://bucket/run (connection refused to 127.0.0.1:{port}); "
        f"retrying, attempt 2/3 within 120 s, Ctrl-C to stop"
    )
    assert lines[0] == want, p.stderr
    assert lines[-1].startswith("shardkeeper: error: ") and "failed 3 time(s)" in lines[-1]
    assert len(lines) == 2, p.stderr  # one notice, one error
    assert elapsed < 12, elapsed  # was about 16 s of silence (the client's own retries)

    p = subprocess.run([*argv, "--quiet"], capture_output=True, text=True, env=env, timeout=100)
    assert p.returncode == 2 and "waiting for" not in p.stderr and "error:" in p.stderr


class _Refusing(LocalStorage):
    """A root whose first ``fail`` reads are refused, like a store that is not up yet."""

    def __init__(self, root: Path, fail: int) -> None:
        super().__init__(root, fsync=False)
        self.fail = fail

    def read_bytes(self, path: str) -> bytes:
        if self.fail:
            self.fail -= 1
            raise ConnectionRefusedError(111, "Connection refused")
        return super().read_bytes(path)


def test_the_library_logs_the_wait_and_prints_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    inner = _Refusing(tmp_path / "r", fail=2)
    inner.put("x", b"1")
    storage = RetryingStorage(inner, RetryPolicy(max_attempts=4, base_delay_s=0.01), seed=0)
    with caplog.at_level(logging.INFO, logger=wait_log.name):
        assert storage.read_bytes("x") == b"1"
    waits = [r for r in caplog.records if r.name == wait_log.name]
    assert len(waits) == 1  # the first retry of the call only
    assert waits[0].getMessage() == f"waiting for {inner.url} (connection refused); retrying, attempt 2/4 within 120 s"
    assert capsys.readouterr() == ("", "")
