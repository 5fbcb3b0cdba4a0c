"""Smoke test of the installed distributions: what a user gets from the wheels and sdists.

Run by the ``tests`` sessions of noxfile.py after they install the freshly built wheels (not
editable), so that CI tests exactly what users install::

    python tests/packaging/smoke.py --dist DIR core [deepspeed lightning accelerate transformers]

For each named distribution it checks that the installed copy came from a wheel (not the
sources, not an editable install), that the wheel installed every source file and ``py.typed``,
and that the sdist in DIR holds the sources, ``pyproject.toml`` and ``README.md``. For the core:
the ``shardkeeper`` console script runs (``--help``), and a save and a restore through the
installed core are bit-exact (then ``python -m shardkeeper.core.cli verify`` on it). For an adapter: it
imports (with its framework installed), and the DeepSpeed adapter's entry point is found.
Exits non-zero, naming every failure.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[2]
#: distribution short name -> (folder under packages/, distribution name, import name)
DISTS = {
    "core": ("core", "shardkeeper-core", "shardkeeper.core"),
    "deepspeed": ("deepspeed_plugin", "shardkeeper-deepspeed", "shardkeeper.deepspeed"),
    "lightning": ("lightning_plugin", "shardkeeper-lightning", "shardkeeper.lightning"),
    "accelerate": ("accelerate_plugin", "shardkeeper-accelerate", "shardkeeper.accelerate"),
    "transformers": ("transformers_plugin", "shardkeeper-transformers", "shardkeeper.transformers"),
}


def _sources(folder: str) -> set[str]:
    """Every file of a distribution's package sources, relative to its ``src/`` folder (not the
    byte code, nor the ``*.egg-info`` a setuptools build leaves there)."""
    src = REPO / "packages" / folder / "src"
    out = set()
    for path in src.rglob("*"):
        parts = path.relative_to(src).parts
        if path.is_file() and "__pycache__" not in parts and not parts[0].endswith(".egg-info"):
            out.add("/".join(parts))
    return out


def check_installed(short: str) -> list[str]:
    """The installed distribution is a wheel install holding every source file and py.typed."""
    folder, dist, module = DISTS[short]
    bad: list[str] = []
    try:
        meta = md.distribution(dist)
    except md.PackageNotFoundError:
        return [f"{dist} is not installed"]
    direct = meta.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        bad.append(f"{dist} is an editable install; the smoke test wants the wheel")
    mod = importlib.import_module(module)
    where = Path(mod.__file__ or "").resolve()
    if (REPO / "packages").resolve() in where.parents:
        bad.append(f"{module} imports from the sources ({where}), not from the installed wheel")
    installed = {str(f) for f in meta.files or ()}
    missing = sorted(_sources(folder) - installed)
    if missing:
        bad.append(f"{dist}'s wheel lacks {missing}")
    typed = where.parent / "py.typed"
    if not typed.is_file():
        bad.append(f"{dist}: no py.typed next to {where} (typed package marker, PEP 561)")
    return bad


def check_sdist(short: str, dist_dir: Path) -> list[str]:
    """The sdist holds pyproject.toml, README.md and every source file."""
    folder, dist, _ = DISTS[short]
    stem = dist.replace("-", "_")
    found = sorted(dist_dir.glob(f"{stem}-*.tar.gz"))
    if len(found) != 1:
        return [f"expected one sdist {stem}-*.tar.gz in {dist_dir}, found {[p.name for p in found]}"]
    with tarfile.open(found[0]) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    have = {n.removeprefix(top + "/") for n in names}
    need = {"pyproject.toml", "README.md", *(f"src/{p}" for p in _sources(folder))}
    missing = sorted(need - have)
    return [f"{found[0].name} lacks {missing}"] if missing else []


def check_cli() -> list[str]:
    """The console script is installed next to the interpreter and runs."""
    eps = [ep for ep in md.entry_points(group="console_scripts", name="shardkeeper")]
    if not eps or eps[0].value != "shardkeeper.core.cli:main":
        return [f"no console script 'shardkeeper = shardkeeper.core.cli:main' (found {eps})"]
    script = shutil.which("shardkeeper", path=str(Path(sys.executable).parent))
    if script is None:
        return [f"the shardkeeper script is not in {Path(sys.executable).parent}"]
    res = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or "usage: shardkeeper" not in res.stdout:
        return [f"shardkeeper --help exited {res.returncode}: {res.stdout[-500:]} {res.stderr[-2000:]}"]
    return []


def check_roundtrip() -> list[str]:
    """Save a model and its optimizer, restore them into fresh ones: bit for bit; verify the root."""
    import torch

    from shardkeeper.core import CheckpointManager

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(8, 16)).square().mean().backward()
        optim.step()
        return model, optim

    def flat(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, bytes]:
        out = {f"model/{k}": v.detach().numpy().tobytes() for k, v in model.state_dict().items()}
        for i, state in optim.state_dict()["state"].items():
            out.update({f"optim/{i}/{k}": v.detach().numpy().tobytes() for k, v in state.items()})
        return out

    with tempfile.TemporaryDirectory() as tmp:
        root = str(Path(tmp) / "run")
        model, optim = make(0)
        mgr = CheckpointManager(root)
        mgr.save(7, {"model": model, "optim": optim}).wait()
        mgr.close()
        fresh, fresh_optim = make(1)
        if flat(fresh, fresh_optim) == flat(model, optim):
            return ["the two seeds gave the same state: the round trip would prove nothing"]
        mgr = CheckpointManager(root)
        step = mgr.restore({"model": fresh, "optim": fresh_optim})
        mgr.close()
        bad = [] if step == 7 else [f"restore returned step {step}, saved 7"]
        before, after = flat(model, optim), flat(fresh, fresh_optim)
        if before.keys() != after.keys() or len(before) < 6:
            bad.append(f"restored keys differ: {sorted(before)} vs {sorted(after)}")
        bad += [f"{k} differs after the restore" for k in before if after.get(k) != before[k]]
        # through the module, so that a missing console script (check_cli) is reported once
        verify = [sys.executable, "-m", "shardkeeper.core.cli", "verify", root]
        res = subprocess.run(verify, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            bad.append(f"verify {root} exited {res.returncode}: {res.stdout[-500:]} {res.stderr[-2000:]}")
    return bad


def check_adapter(short: str) -> list[str]:
    """The adapter imports; the DeepSpeed one is also found through its entry point."""
    _, dist, module = DISTS[short]
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        return [f"import {module} failed: {type(exc).__name__}: {exc}"]
    if short == "deepspeed":
        from shardkeeper.core.adapter.registry import load_adapter

        if load_adapter("deepspeed").__name__ != module:
            return [f"load_adapter('deepspeed') did not return {module}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, required=True, help="folder with the built wheels and sdists")
    parser.add_argument("names", nargs="+", choices=sorted(DISTS), help="distributions to check")
    args = parser.parse_args(argv)
    if any(str(REPO / "packages") in p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        print("PYTHONPATH points into packages/: unset it, the smoke test checks the installed wheels")
        return 2
    bad: list[str] = []
    for short in args.names:
        installed = check_installed(short)
        bad += installed + check_sdist(short, args.dist)
        if installed[:1] == [f"{DISTS[short][1]} is not installed"]:
            continue
        if short == "core":
            bad += check_cli() + check_roundtrip()
        else:
            bad += check_adapter(short)
    for line in bad:
        print(f"FAILED: {line}")
    print(f"packaging smoke test: {len(args.names)} distributions, {len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
