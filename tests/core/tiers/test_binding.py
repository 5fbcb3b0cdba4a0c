"""How a local tier directory is bound to its persistent root: a checkpoint root is never
adopted as a local tier, a local tier is never taken for a root, and a root is one root
through any symlink to it (docs/tiers.md, "What a node is")."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.tiers.nodes import NODE_TOKEN, ROOT_NAME, bind_root

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step)), "b": torch.arange(8) + step}


def _blank() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state(0).items()}


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def _save_plain(root: Path, *steps: int) -> None:
    with CheckpointManager(root) as mgr:
        for step in steps:
            mgr.save(step, _state(step)).wait()


def test_a_plain_root_is_not_adopted_as_a_local_tier(tmp_path: Path) -> None:
    """Run B's root passed as run A's local=: refused by name, and B's steps stay B's."""
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    _save_plain(root_b, 10, 20, 30)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(root_a, local=root_b, local_keep=1, persist_every=100)
    said = str(e.value)
    assert str(root_b) in said and "LATEST, step-000000000010, step-000000000020, step-000000000030" in said
    assert f"no {ROOT_NAME}" in said and "empty local= directory" in said and f"pass {root_b} as the root" in said
    assert _steps(root_b) == [10, 20, 30]
    assert not (root_b / ROOT_NAME).exists() and not (root_b / NODE_TOKEN).exists()  # nothing written
    target = _blank()
    with CheckpointManager(root_b) as mgr:
        assert mgr.restore(target) == 30
    assert torch.equal(target["w"], _state(30)["w"])
    # a fresh directory is bound as ever, and A starts from nothing
    with CheckpointManager(root_a, local=tmp_path / "fresh", local_keep=1, persist_every=100) as mgr:
        assert mgr.latest_step() is None
        mgr.save(40, _state(40)).wait()
    assert _steps(tmp_path / "fresh") == [40] and _steps(root_b) == [10, 20, 30]


@pytest.mark.parametrize(
    "leftover",
    [
        "LATEST",
        "pending.intent.step-000000000005.ab12cd34.json",
        "pending.claim.0123abcd.json",
        "step-000000000005/",  # a save that never committed
        "preempted.json",
    ],
)
def test_what_a_root_holds_is_refused_without_the_marker(tmp_path: Path, leftover: str) -> None:
    local = tmp_path / "local"
    (local / NODE_TOKEN).parent.mkdir()
    (local / NODE_TOKEN).write_text("0" * 32)  # a tier's own file does not make the rest the tier's
    if leftover.endswith("/"):
        (local / leftover).mkdir()
    else:
        (local / leftover).write_text("5\n")
    name = leftover.rstrip("/")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(local))} holds {re.escape(name)} but no "):
        CheckpointManager(tmp_path / "root", local=local)
    assert not (local / ROOT_NAME).exists()


def test_a_node_directory_is_bound_only_with_its_own_marker(tmp_path: Path) -> None:
    """The same job's node directory (steps and marker) reopens; a replaced node's empty one
    and one holding files that are no checkpoint's bind; the tier's own steps without the
    marker naming this root do not."""
    root, node = tmp_path / "root", tmp_path / "node"
    with CheckpointManager(root, local=node, persist_every=2, local_keep=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step)).wait()
        mgr.wait_persisted()
    target = _blank()
    with CheckpointManager(root, local=node) as mgr:  # the job restarted on the same node
        assert mgr.restore(target) == 4 and mgr.last_restore_tier == "local"
    assert torch.equal(target["w"], _state(4)["w"])
    replaced = tmp_path / "replaced"
    replaced.mkdir()
    with CheckpointManager(root, local=replaced) as mgr:  # an empty directory: the persisted step
        assert mgr.restore(target) == 3 and mgr.last_restore_tier == "persistent"
    mount = tmp_path / "mount"
    (mount / "lost+found").mkdir(parents=True)
    (mount / "sem.other-program").write_bytes(b"x")
    with CheckpointManager(root, local=mount, persist_every=2) as mgr:
        mgr.restore(target)
        mgr.save(5, _state(5)).wait()
    assert (mount / "lost+found").is_dir() and (mount / "sem.other-program").read_bytes() == b"x"
    (node / ROOT_NAME).unlink()  # the tier's steps without the marker: some root's, not this tier's
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(node))} holds LATEST, step-000000000003, step-000000000004 but no"
    ):
        CheckpointManager(root, local=node)
    (node / ROOT_NAME).write_text(str(tmp_path / "elsewhere"))
    with pytest.raises(CheckpointError, match="holds the local tier of the root"):
        CheckpointManager(root, local=node)
    assert _steps(node) == [3, 4]


def test_a_local_tier_directory_is_refused_as_a_root(tmp_path: Path) -> None:
    """With or without local=, and with the two arguments swapped: a node's directory is
    never a manager's root; the tier and the persistent root stay as they were."""
    root, node = tmp_path / "root", tmp_path / "node"
    with CheckpointManager(root, local=node, persist_every=1) as mgr:
        mgr.save(1, _state(1)).wait()
    said = rf"CheckpointManager\(\): {re.escape(str(node))} is a node's local tier directory of the root "
    with pytest.raises(CheckpointError, match=said + re.escape(repr(str(root)))):
        CheckpointManager(node)
    with pytest.raises(CheckpointError, match=said):
        CheckpointManager(node, local=tmp_path / "other")
    with pytest.raises(CheckpointError, match=said):
        CheckpointManager(node, local=root)  # swapped in a launcher
    assert not (root / ROOT_NAME).exists() and not (tmp_path / "other").exists()
    token_only = tmp_path / "token-only"
    token_only.mkdir()
    (token_only / NODE_TOKEN).write_text("0" * 32)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(token_only))} is a node's local tier directory \("):
        CheckpointManager(token_only)
    target = _blank()
    with CheckpointManager(root, local=node) as mgr:
        assert mgr.restore(target) == 1 and mgr.last_restore_tier == "local"
    assert _steps(node) == [1] and _steps(root) == [1]


def test_a_root_named_through_a_symlink_keeps_its_local_tier(tmp_path: Path) -> None:
    real, link, node = tmp_path / "real", tmp_path / "link", tmp_path / "node"
    real.mkdir()
    os.symlink(real, link)
    with CheckpointManager(link, local=node, persist_every=1) as mgr:
        mgr.save(1, _state(1)).wait()
    target = _blank()
    with CheckpointManager(real, local=node, persist_every=1) as mgr:  # the same root by its real path
        assert mgr.restore(target) == 1 and mgr.last_restore_tier == "local"
        mgr.save(2, _state(2)).wait()
    with CheckpointManager(link, local=node) as mgr:
        assert mgr.restore(target) == 2 and mgr.last_restore_tier == "local"
    assert (node / ROOT_NAME).read_text() == str(real)  # the root's identity: its real path
    # a marker that names the root as it was given (a symlink) binds its real path too
    older = tmp_path / "older"
    older.mkdir()
    (older / ROOT_NAME).write_text(str(link))
    with CheckpointManager(real, local=older) as mgr:
        assert mgr.restore(target) == 2 and mgr.last_restore_tier == "persistent"
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(other, tmp_path / "other-link")
    with pytest.raises(CheckpointError, match="holds the local tier of the root"):
        CheckpointManager(tmp_path / "other-link", local=node)


def test_object_store_roots_are_bound_by_their_url(tmp_path: Path) -> None:
    """An object store's URL is no local path: bound as its URL (one trailing ``/`` aside)."""
    node = LocalStorage(tmp_path / "node")
    bind_root(node, "s3://bucket/run")
    assert (tmp_path / "node" / ROOT_NAME).read_text() == "s3://bucket/run"
    bind_root(node, "s3://bucket/run/")
    with pytest.raises(CheckpointError, match="holds the local tier of the root 's3://bucket/run', not of 's3"):
        bind_root(node, "s3://bucket/other")
