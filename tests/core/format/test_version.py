"""One format_version and the extension rule (docs/format.md 10), through the public paths.

Every writer writes format_version 1 and names in ``requires`` exactly the features the step
uses. A reader ignores a top-level field it does not know; a step that requires a feature it
does not know, or that has another format_version (a pre-release build's), is committed but
unreadable: restore (the newest or by number), load, inspect and verify refuse it naming the
step, the feature or version and the remedy, never falling back past it; a member whose
feature is not required, or a requirement without its member, is damage.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError, IncompatibleFormatError, step_dir
from shardkeeper.core.format.manifest import Manifest
from tests.core._builders import run_cli


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "ids": torch.arange(6) * seed, "meta": {"seed": seed}}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(8, 4), "ids": torch.zeros(6, dtype=torch.int64), "meta": {"seed": 0}}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return (
        torch.equal(got["w"].view(torch.int32), want["w"].view(torch.int32))
        and torch.equal(got["ids"], want["ids"])
        and got["meta"] == want["meta"]
    )


def _two_steps(root: Path) -> Path:
    """Steps 1 and 2 saved; the path of step 2's manifest."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    return root / step_dir(2) / "manifest.json"


def _edit(path: Path, **members: Any) -> None:
    doc = json.loads(path.read_text())
    doc.update(members)
    path.write_text(json.dumps(doc))


def test_a_manifest_with_an_unknown_optional_field_reads_everywhere(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = _two_steps(tmp_path)
    _edit(path, hologram={"since": "a later release", "nested": [1, {"x": None}]}, zz_note="ignored")
    target = _target()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 2
        assert _same(target, _state(2))
        loaded = mgr.load(2)
        assert torch.equal(loaded["w"].view(torch.int32), _state(2)["w"].view(torch.int32))
    code, out, _ = run_cli(capsys, "verify", tmp_path)
    assert code == 0, out
    code, out, _ = run_cli(capsys, "inspect", tmp_path, 2)
    assert code == 0 and "format version" in out and " 1" in out, out


@pytest.mark.parametrize(
    ("members", "named"),
    [
        ({"requires": ["hologram"]}, "requires 'hologram'"),
        ({"requires": ["described", "hologram"]}, "requires 'hologram'"),  # (the unknown one is named first)
        ({"format_version": 5}, "format_version 5"),
        ({"format_version": 2}, "format_version 2"),
    ],
    ids=["unknown-feature", "unknown-beside-known", "pre-release-5", "pre-release-2"],
)
def test_an_unreadable_newest_step_is_refused_through_restore_load_verify_and_inspect(
    tmp_path: Path,
    capsys,
    members: dict[str, Any],
    named: str,  # type: ignore[no-untyped-def]
) -> None:
    path = _two_steps(tmp_path)
    _edit(path, **members)
    remedy = "upgrade shardkeeper-core" if "requires" in members else "pre-release build"
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [1, 2]  # committed: a newer or older build wrote it
        for step in (None, 2):  # no fallback to step 1: its progress would be lost silently
            target = _target()
            with pytest.raises(IncompatibleFormatError) as e:
                mgr.restore(target, step=step)
            msg = str(e.value)
            assert named in msg and remedy in msg and str(path) in msg and "(step 2)" in msg, msg
            assert target["meta"] == {"seed": 0}
        with pytest.raises(IncompatibleFormatError, match=remedy):
            mgr.load(2)
        target = _target()
        assert mgr.restore(target, step=1) == 1 and _same(target, _state(1))  # the others read as before
    code, out, err = run_cli(capsys, "verify", tmp_path)
    assert code != 0 and named in out + err and remedy in out + err, out + err
    code, out, err = run_cli(capsys, "inspect", tmp_path, 2)
    assert code != 0 and named in out + err, out + err
    code, out, _ = run_cli(capsys, "ls", tmp_path)
    assert "other-format" in out, out


def test_a_pre_release_manifest_with_extended_values_is_refused_as_such_not_as_damage(tmp_path: Path) -> None:
    """A pre-release build declared NaN and big integers by a member, not by ``requires``: its
    manifest still parses far enough to be refused for its version (never quarantined as
    damage by a restore that falls back past it)."""
    path = _two_steps(tmp_path)
    doc = json.loads(path.read_text())
    doc.update(format_version=6, extended_json=True)
    doc["metadata"]["best"] = math.nan
    path.write_bytes(json.dumps(doc, allow_nan=True).encode())
    with pytest.raises(IncompatibleFormatError, match="format_version 6.*pre-release build"):
        Manifest.loads(path.read_bytes(), where=str(path))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(IncompatibleFormatError):
        mgr.restore(_target())
    assert path.exists()


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ({"format_version": 0}, "versions start at 1"),
        ({"requires": "described"}, "not a list of distinct feature names"),
        ({"requires": ["extended-json", "extended-json"]}, "not a list of distinct feature names"),
        ({"requires": [7]}, "not a list of distinct feature names"),
        ({"requires": ["encryption"]}, "requires 'encryption' but has no member encryption"),
        ({"requires": ["described"]}, "requires 'described' but has no member described"),
        (
            {"encryption": {"algorithm": "AES-256-GCM", "key_id": "k", "wrapped_mac_key": "", "root": "/r"}},
            "has the member encryption but does not require 'encryption'",
        ),
        (
            {"requires": ["encryption"], "encryption": {"algorithm": "AES-256-GCM", "key_id": "k"}},
            "names no root it is bound to",
        ),
    ],
    ids=["version-0", "not-a-list", "twice", "not-a-string", "encryption", "described", "member", "unbound"],
)
def test_a_requirement_and_its_member_go_together_or_the_step_is_damage(
    tmp_path: Path, edit: dict[str, Any], why: str
) -> None:
    """Damage, not a newer format: restore of the newest falls back past it."""
    path = _two_steps(tmp_path)
    _edit(path, **edit)
    with pytest.raises(CorruptCheckpointError, match=why):
        Manifest.loads(path.read_bytes(), where=str(path))
    target = _target()
    with pytest.warns(UserWarning, match="damaged"), CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 1
    assert _same(target, _state(1))


def test_every_writer_writes_version_1_and_requires_exactly_what_the_step_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.core.format.test_described import _write as write_described
    from tests.core.format.test_paged_damage import _manifest as paged_manifest
    from tests.core.format.test_paged_damage import _save as save_paged

    def doc(root: Path, step: int = 1) -> dict[str, Any]:
        raw = (root / step_dir(step) / "manifest.json").read_bytes()
        return json.loads(raw.decode(), parse_constant=float)

    with CheckpointManager(tmp_path / "plain", compression="zstd", async_save=False) as mgr:
        mgr.save(1, {"z": torch.zeros(64, 1024), **_state(1)})
    with CheckpointManager(tmp_path / "extended", async_save=False) as mgr:
        mgr.save(1, _state(1), metadata={"best": math.inf})
    monkeypatch.setenv("SK_FORMAT_KEY", base64.b64encode(bytes(range(32))).decode())
    pytest.importorskip("cryptography")
    with CheckpointManager(tmp_path / "sealed", encryption="env:SK_FORMAT_KEY", async_save=False) as mgr:
        mgr.save(1, _state(1), metadata={"seed": 2**70})
    write_described(tmp_path / "described")
    save_paged(tmp_path / "paged", 1, "0000000a")
    got = {name: doc(tmp_path / name) for name in ("plain", "extended", "sealed", "described")}
    got["paged"] = paged_manifest(tmp_path / "paged", 1)
    assert {k: (d["format_version"], d.get("requires")) for k, d in got.items()} == {
        "plain": (1, None),  # zstd chunks: encodings are of the core schema
        "extended": (1, ["extended-json"]),
        "sealed": (1, ["encryption", "extended-json"]),
        "described": (1, ["described"]),
        "paged": (1, ["described", "pages"]),
    }
    assert all(list(d)[:2] == ["format_version", "requires"] for d in got.values() if "requires" in d)
    with CheckpointManager(tmp_path / "sealed", encryption="env:SK_FORMAT_KEY") as mgr:
        target = _target()
        assert mgr.restore(target) == 1 and _same(target, _state(1))
        assert mgr.manifest(1).requires == ("encryption", "extended-json")
