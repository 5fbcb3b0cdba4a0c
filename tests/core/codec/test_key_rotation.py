"""Key rotation with incremental saves: a provider that wraps with a new key and unwraps the old
and the new one. A save after the rotation never references a file sealed under the old key
(it is full once, then incremental again on the new key), so the old key can be retired and the
newest step still restores; ``shardkeeper keys`` names the key ids each step needs; ``verify``
with a key that lacks one says so, and calls it neither uncommitted nor tampered with."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, ChecksumMismatchError, EncryptionKeyError, LocalKeyProvider
from shardkeeper.core.codec.crypto import EncryptedStorage
from shardkeeper.core.codec.crypto_format import read_header, root_identity
from shardkeeper.core.codec.crypto_manifest import manifest_section, seal_manifest
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.commit.files import referenced_paths
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify.root import verify_root
from tests.checks import assert_same_state

pytest.importorskip("cryptography")
pytestmark = pytest.mark.timeout(120)

A = LocalKeyProvider(b"\xaa" * 32, "key A")
B = LocalKeyProvider(b"\xbb" * 32, "key B")


class Rotated:
    """A provider after a rotation: wraps with ``current``, unwraps with any of ``held``."""

    def __init__(self, current: LocalKeyProvider, *held: LocalKeyProvider) -> None:
        self.current, self.held, self.key_id = current, {p.key_id: p for p in held}, current.key_id

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        return self.current.wrap(data_key)

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        if key_id not in self.held:
            raise EncryptionKeyError(f"this provider holds no key {key_id}")
        return self.held[key_id].unwrap(key_id, wrapped)


def _state(v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"frozen": torch.randn(256, 64, generator=g), "w": torch.full((64, 16), float(v))}


def _target() -> dict[str, Any]:
    return {"frozen": torch.zeros(256, 64), "w": torch.zeros(64, 16)}


def _file_keys(root: Path, step: int) -> dict[str, str]:
    """Every data file step ``step`` needs (its own and referenced ones) -> its key id."""
    raw = open_storage(str(root))
    m = load_manifest(raw, step)
    return {p: read_header(raw, p)[1]["key_id"] for p in referenced_paths(step, m) if "/data/" in p}


def _save(root: Path, keys: Any, *steps: int) -> None:
    with CheckpointManager(root, encryption=keys, incremental=True, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


def _rotated_root(root: Path) -> None:
    """Steps 1, 2 under A (2 references 1's frozen chunk), then 3, 4 after rotating to B."""
    _save(root, A, 1, 2)
    assert step_dir(1) in "".join(_file_keys(root, 2)), "step 2 should reference step 1's file"
    _save(root, Rotated(B, A, B), 3, 4)


def test_a_save_after_rotation_references_no_file_of_the_old_key(tmp_path: Path) -> None:
    root = tmp_path / "r"
    _rotated_root(root)
    # step 3 is full under B; step 4 is incremental again, on step 3's B files
    assert set(_file_keys(root, 3).values()) == {B.key_id}, _file_keys(root, 3)
    four = _file_keys(root, 4)
    assert set(four.values()) == {B.key_id}, four
    assert any(p.startswith(step_dir(3) + "/") for p in four), "step 4 should reuse step 3's unchanged chunk"
    # retire A: the newest step restores bit for bit, without falling back
    target = _target()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(root, encryption=B) as mgr:
            assert mgr.restore(target) == 4
    assert_same_state(target, _state(4))


def _reseal(root: Path, step: int, keys: LocalKeyProvider) -> None:
    """Seal step ``step``'s manifest under ``keys``, its files as they are: what an incremental
    save after a rotation wrote before the fix (a new-key manifest over old-key files)."""
    path = root / step_dir(step) / "manifest.json"
    data = path.read_bytes()
    assert manifest_section(data) is not None
    plain = data[: data.rfind(b',"encryption":{')] + b"}"
    path.write_bytes(seal_manifest(plain, keys, root_identity(str(root))))


def test_a_base_over_old_key_files_is_not_reused(tmp_path: Path) -> None:
    """The decision is taken per file: a base whose manifest is sealed under the new key but
    whose chunks lie in old-key files (a root saved before the fix) is not referenced."""
    root = tmp_path / "r"
    _save(root, A, 1, 2)
    _reseal(root, 2, B)  # step 2: a B manifest over A files
    _save(root, Rotated(B, A, B), 3)
    assert set(_file_keys(root, 3).values()) == {B.key_id}, _file_keys(root, 3)
    target = _target()
    with CheckpointManager(root, encryption=B) as mgr:
        assert mgr.restore(target, step=3) == 3
    assert_same_state(target, _state(3))


def _keys_json(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    from shardkeeper.core.cli import main

    capsys.readouterr()
    assert main(["keys", str(root), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_keys_lists_exactly_the_key_ids_each_step_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardkeeper.core.cli import main

    root = tmp_path / "r"
    _rotated_root(root)
    _reseal(root, 2, B)  # a B manifest over A files: its files' key counts, not the manifest's alone
    out = _keys_json(root, capsys)
    assert {s["step"]: sorted(s["keys"]) for s in out["steps"]} == {
        1: [A.key_id],
        2: sorted([A.key_id, B.key_id]),
        3: [B.key_id],
        4: [B.key_id],
    }
    assert {k["key_id"]: k["steps"] for k in out["keys"]} == {A.key_id: [1, 2], B.key_id: [2, 3, 4]}
    assert out["unknown"] == []
    assert main(["keys", str(root)]) == 0
    text = capsys.readouterr().out
    assert f"{A.key_id}" in text and "steps 1-2" in text, text
    # once retention has deleted the steps that need A, only B is listed: A may be retired
    assert main(["delete", str(root), "1"]) == 0 and main(["delete", str(root), "2"]) == 0
    out = _keys_json(root, capsys)
    assert [k["key_id"] for k in out["keys"]] == [B.key_id]


def test_verify_says_which_key_is_missing_not_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Verified with B alone: the steps sealed under A, and a step whose manifest is B's but
    whose files are A's, are reported as needing key A (kind ``key``): not as uncommitted, not
    as replaced or tampered with, and ``delete --damaged`` deletes none of them."""
    from shardkeeper.core.lifecycle.delete_damaged import delete_damaged

    root = tmp_path / "r"
    _save(root, A, 1, 2)
    _reseal(root, 2, B)
    _save(root, Rotated(B, A, B), 3)
    storage = EncryptedStorage(open_storage(str(root)), B).authenticated()
    report = verify_root(storage)
    problems = report.all_problems
    assert {p.step for p in problems} == {1, 2}, [p.message for p in problems]
    for p in problems:
        assert p.kind == "key", p
        assert A.key_id in p.message and "not committed" not in p.message, p.message
        assert "replaced or tampered" not in p.message, p.message
    assert any("shardkeeper keys" in p.message for p in problems)
    assert [r.step for r in report.steps if r.ok] == [3]
    key_b = tmp_path / "b.key"
    key_b.write_bytes(b"\xbb" * 32)
    from shardkeeper.core.cli import main

    capsys.readouterr()
    assert main(["verify", str(root), "--key", f"file:{key_b}"]) == 1
    said = capsys.readouterr()
    assert "step 2: NOT CHECKED" in said.out and "DAMAGED" not in said.out, said.out
    assert "not committed" not in said.out and "replaced or tampered" not in said.out, said.out
    assert "not damage" in said.err, said.err
    for step in (1, 2):
        with pytest.raises((ValueError, EncryptionKeyError)) as caught:
            delete_damaged(EncryptedStorage(open_storage(str(root)), B), step)
        assert "nothing was deleted" in str(caught.value) or "wrong key" in str(caught.value)
    assert (root / step_dir(1) / "manifest.json").exists() and (root / step_dir(2) / "manifest.json").exists()
    # a restore of that step names the key it lacks, not tampering
    with CheckpointManager(root, encryption=B) as mgr, pytest.raises(ChecksumMismatchError) as err:
        mgr.restore(_target(), step=2)
    assert A.key_id in str(err.value) and "replaced or tampered" not in str(err.value)
