"""Progress bars of the CLI (core/util/bars.py): on stderr when it is a terminal, never on a pipe,
never in stdout; --json stdout stays JSON. Real processes, stderr on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from shardkeeper.core.storage import LocalStorage

try:
    from .._builders import age_everything, tensor, write_step
except ImportError:
    from _builders import age_everything, tensor, write_step

pytestmark = pytest.mark.timeout(120)

#: What a tqdm bar draws: its percentage and the bar's edge.
BAR = "100%|"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["COLUMNS"] = "100"
    return env


def _cli(*argv: object, tty_stderr: bool) -> tuple[int, str, str]:
    """Run ``shardkeeper ARGV`` in a new process: stdout a pipe, stderr a pipe or a pty."""
    cmd = [sys.executable, "-m", "shardkeeper.core.cli", *map(str, argv)]
    if not tty_stderr:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=100)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=_env())
    os.close(slave)
    err = b""
    while True:  # drain the pty while the process runs (it blocks once the pty buffer is full)
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(timeout=60), out, err.decode(errors="replace")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "run"
    storage = LocalStorage(root, fsync=False)
    for step in (1, 2):
        write_step(storage, step, {"model/w": tensor("float32", (256, 64), step), "model/b": tensor("float32", (64,))})
    return root


def test_verify_bar_on_a_terminal(root: Path) -> None:
    code, out, err = _cli("verify", root, tty_stderr=True)
    assert code == 0, err
    assert "verify" in err and BAR in err  # the bar, by bytes
    assert "KiB" in err or "B/s" in err
    assert BAR not in out and "step 1: OK" in out and "step 2: OK" in out


def test_no_bar_on_a_pipe(root: Path) -> None:
    code, out, err = _cli("verify", root, tty_stderr=False)
    assert code == 0 and err == "" and "step 2: OK" in out
    code, out, err = _cli("ls", root, tty_stderr=False)
    assert code == 0 and err == "" and "LATEST" in out


def test_no_progress_hides_it_on_a_terminal(root: Path) -> None:
    code, out, err = _cli("verify", root, "--no-progress", tty_stderr=True)
    assert code == 0 and BAR not in err and "%|" not in err


def test_json_stdout_stays_json(root: Path) -> None:
    # By default --json shows no bar; --progress forces one, on stderr only.
    code, out, err = _cli("verify", root, "--json", tty_stderr=True)
    assert code == 0 and BAR not in err and json.loads(out)["ok"] is True
    code, out, err = _cli("verify", root, "--json", "--progress", tty_stderr=True)
    assert code == 0 and BAR in err
    assert [s["step"] for s in json.loads(out)["steps"]] == [1, 2]
    # --quiet hides bars too; --progress on a pipe still draws one there (forced).
    code, out, err = _cli("verify", root, "--quiet", tty_stderr=True)
    assert code == 0 and BAR not in err
    code, out, err = _cli("verify", root, "1", "--progress", tty_stderr=False)
    assert code == 0 and BAR in err and BAR not in out


def test_export_bar_and_json(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    code, out, err = _cli("export", root, "--to", tmp_path / "hf", tty_stderr=True)
    assert code == 0, err
    assert "export step 2" in err and BAR in err and BAR not in out
    code, out, err = _cli("export", root, "1", "--to", tmp_path / "hf1", "--json", "--progress", tty_stderr=True)
    assert code == 0 and BAR in err
    assert json.loads(out)["step"] == 1


def test_gc_bar_by_paths(tmp_path: Path) -> None:
    root = tmp_path / "run"
    storage = LocalStorage(root, fsync=False)
    write_step(storage, 1, {"model/w": tensor("float32", (4, 4))})
    for step in (2, 3):  # failed saves: shard files, no manifest
        write_step(storage, step, {"model/w": tensor("float32", (4, 4))}, commit=False, latest=False)
    age_everything(root)
    code, out, err = _cli("gc", root, "--dry-run", tty_stderr=True)
    assert code == 0 and "gc (dry run)" in err and "2/2" in err and BAR in err
    assert "gc: would remove 2 path(s)" in out and BAR not in out
    code, out, err = _cli("gc", root, tty_stderr=False)
    assert code == 0 and err == "" and "gc: removed 2 path(s)" in out
