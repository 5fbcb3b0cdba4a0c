"""`nox -s bench` runs every benchmark whatever the earlier ones did: benchmarks/suite.py runs
each in its own process under a time limit, collects the missed targets, and fails only at the
end, with a summary. Tiny scripts written here stand in for the benchmarks: this tests the driver."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(120)


def _suite() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("suite")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _script(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / name).write_text(body)
    return name


def test_a_miss_a_crash_and_a_hang_do_not_stop_the_benchmarks_after_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = _suite()
    miss = _script(tmp_path, "miss.py", "print('| save stall | a-16 | 1.0 | 2.0 | 2.0 | <= 1.5 | MISS |')\n")
    crash = _script(tmp_path, "crash.py", "raise RuntimeError('broken benchmark')\n")
    hang = _script(tmp_path, "hang.py", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    after = _script(tmp_path, "after.py", "open('after.ran', 'w').write('yes')\nprint('| x | PASS |')\n")
    outcomes = suite.run_all(
        [
            suite.Bench("miss", (miss,), 60),
            suite.Bench("crash", (crash,), 60),
            suite.Bench("hang", (hang,), 3),
            suite.Bench("after", (after,), 60),
        ],
        cwd=tmp_path,
    )
    assert (tmp_path / "after.ran").read_text() == "yes", "the benchmark after the failing ones did not run"
    assert [(o.name, o.status) for o in outcomes] == [
        ("miss", "missed"),
        ("crash", "failed"),
        ("hang", "timed out"),
        ("after", "ok"),
    ]
    assert outcomes[0].misses == ["| save stall | a-16 | 1.0 | 2.0 | 2.0 | <= 1.5 | MISS |"]
    assert outcomes[1].returncode == 1 and outcomes[2].wall_s < 30
    assert suite.exit_status(outcomes) == 2
    text = suite.summary(outcomes)
    assert "missed 1 target" in text and "failed (exit 1)" in text and "timed out" in text
    assert "MISS |" in text.split("miss:", 1)[1], text
    out = capsys.readouterr().out
    assert "started" in out and "broken benchmark" in out, "a benchmark's output was not passed through"


def test_the_exit_status_says_missed_apart_from_failed() -> None:
    suite = _suite()
    ok, missed = suite.Outcome("a"), suite.Outcome("b", status="missed", misses=["MISS"])
    assert suite.exit_status([ok]) == 0
    assert suite.exit_status([ok, missed]) == 1
    assert suite.exit_status([missed, suite.Outcome("c", status="failed", returncode=3)]) == 2


def test_the_bench_session_runs_every_benchmark_through_the_driver() -> None:
    """One ``session.run`` there, of the driver: a failing benchmark run straight from the session
    would end it before the benchmarks after it."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    [bench] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "bench"]
    runs = [
        [a.value for a in call.args if isinstance(a, ast.Constant)]
        for call in ast.walk(bench)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "run"
    ]
    assert runs == [["python", "benchmarks/suite.py"]], runs
    suite = _suite()
    names = [b.name for b in suite.benches([])]
    assert names == ["run", "loop", "gil", "direct_io", "scale", "ranks16", "tiers"]
    for b in suite.benches(["--quick"]):
        assert (ROOT / b.argv[0]).is_file(), b
        assert "--quick" in b.argv or b.name == "ranks16", b
