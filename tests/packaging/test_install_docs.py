"""The README's install instructions agree with the distributions and with CI.

- The requirements table of "Install" lists exactly each pyproject.toml's dependencies and
  extras, so that the two cannot drift.
- Every ``pip install`` of the README names folders that exist and extras that are declared,
  and installs an adapter from a folder only together with the core.
- ``.ci/run`` runs exactly the README's test command, which keeps nox in a virtual
  environment of its own (PEP 668 systems refuse ``pip install`` outside one), and that
  folder is git-ignored.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FOLDERS = sorted(p.parent for p in (REPO / "packages").glob("*/pyproject.toml"))


def _projects() -> dict[str, dict]:
    """distribution name -> its [project] table."""
    out = {}
    for folder in FOLDERS:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        out[project["name"]] = {**project, "folder": folder.name}
    return out


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _table() -> dict[tuple[str, str], list[str]]:
    """(distribution, extra or "-") -> the requirements the README's table lists for it."""
    header = "| distribution | extra | brings | for |"
    lines = _section("Install").splitlines()
    rows = lines[lines.index(header) + 2 :]
    out: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if not row.startswith("|"):
            break
        dist, extra, brings = (cell.strip() for cell in row.strip("|").split("|")[:3])
        key = (dist.strip("`"), extra.strip("`"))
        assert key not in out, f"README's requirements table repeats {key}"
        out[key] = re.findall(r"`([^`]+)`", brings)
        assert out[key] or brings == "nothing", f"{key}: list requirements in backticks, or 'nothing'"
    return out


def test_requirements_table_matches_every_pyproject() -> None:
    declared: dict[tuple[str, str], list[str]] = {}
    for name, project in _projects().items():
        declared[(name, "-")] = project.get("dependencies", [])
        for extra, reqs in project.get("optional-dependencies", {}).items():
            declared[(name, extra)] = reqs
    table = _table()
    assert sorted(table) == sorted(declared), "rows of README's requirements table vs the pyproject.toml files"
    for key, reqs in declared.items():
        assert sorted(table[key]) == sorted(reqs), f"{key}: README lists {table[key]}, pyproject.toml {reqs}"


def test_every_adapter_that_needs_the_deepspeed_adapter_has_an_extra_for_it() -> None:
    """Lightning's DeepSpeedStrategy, Accelerate's DEEPSPEED and a Trainer under DeepSpeed all
    delegate to shardkeeper-deepspeed."""
    projects = _projects()
    for name in ("shardkeeper-lightning", "shardkeeper-accelerate", "shardkeeper-transformers"):
        assert projects[name]["optional-dependencies"]["deepspeed"] == ["shardkeeper-deepspeed>=0.1.0"]


def _pip_installs(text: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in ``text`` (code blocks and inline code)."""
    found = []
    for m in re.finditer(r"pip install ([^`\n]+)", text):
        args = shlex.split(m.group(1).split("#")[0])
        found.append([a for a in args if not a.startswith("-")])
    return found


def _split(requirement: str) -> tuple[str, set[str]]:
    m = re.fullmatch(r"([^\[\]=<>]+)(?:\[([\w,]+)\])?(?:[=<>].*)?", requirement)
    assert m, requirement
    return m.group(1), set(filter(None, (m.group(2) or "").split(",")))


def test_every_install_command_names_real_folders_and_declared_extras() -> None:
    projects = _projects()
    by_folder = {f"./packages/{p['folder']}": name for name, p in projects.items()}
    commands = _pip_installs(_section("Install"))
    assert len(commands) >= 4, commands
    for args in commands:
        folders = []
        for arg in args:
            where, extras = _split(arg)
            if where.startswith("./"):
                assert where in by_folder, f"pip install {arg}: no distribution in {where}"
                name = by_folder[where]
                folders.append(name)
            elif where in projects:
                name = where
            else:
                assert where in ("torch",), f"pip install {arg}: neither a distribution of ours nor torch"
                continue
            unknown = extras - set(projects[name].get("optional-dependencies", {}))
            assert not unknown, f"pip install {arg}: {name} declares no extra {sorted(unknown)}"
        if any(name != "shardkeeper-core" for name in folders):
            # an adapter from a folder resolves shardkeeper-core only from the same command
            assert "shardkeeper-core" in folders, f"pip install {' '.join(args)}: the core must be in the command"


def _quick_start_commands() -> dict[str, str]:
    """session -> the README's one-line command that runs it."""
    block = re.findall(r"```\n(.*?)\n```", _section("Quick start"), re.S)
    out = {}
    for command in block:
        m = re.search(r"-m nox -s (\w+)$", command)
        assert m, command
        out[m.group(1)] = command
    return out


def test_ci_runs_exactly_the_readme_test_command() -> None:
    commands = _quick_start_commands()
    assert set(commands) == {"demo", "tests"}, commands
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci == [commands["tests"]], f".ci/run runs {ci}, the README {commands['tests']!r}"


def test_readme_commands_keep_nox_in_a_git_ignored_venv() -> None:
    """No bare ``python3 -m pip install``: externally managed Pythons (PEP 668) refuse it."""
    ignored = (REPO / ".gitignore").read_text().splitlines()
    for session, command in _quick_start_commands().items():
        steps = [s.strip() for s in command.split("&&")]
        m = re.fullmatch(r"python3 -m venv (\S+)", steps[0])
        assert m, f"{session}: the command must start by making nox's venv: {command}"
        venv = m.group(1)
        assert f"{venv}/" in ignored, f"{venv}/ is not in .gitignore"
        for step in steps[1:]:
            assert step.startswith(f"{venv}/bin/python -m "), f"{session}: {step!r} runs outside {venv}"
        assert re.search(r"pip install --quiet nox==[\d.]+", steps[1]), steps[1]
