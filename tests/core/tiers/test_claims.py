"""Step claims in one process: a manager with a local tier claims each step on the persistent
root before its local commit; what removes the claims; a restore that takes them over; and
a step whose local and persistent copies are different saves (two writers), refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointError, CheckpointManager, StepClaimedError
from shardkeeper.core.commit.claim import claim_path, list_claims
from shardkeeper.core.lifecycle.gc import collect_garbage
from shardkeeper.core.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)


def _state(step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + seed)
    return {"w": torch.randn(32, 16, generator=g)}


def _blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(32, 16)}


def test_claims_last_until_a_step_above_them_is_persisted_and_delete_and_gc_remove_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root, local=tmp_path / "a", persist_every=3) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step)).wait()
            mgr.wait_persisted()
        assert mgr.persisted_steps == [1, 4]
        assert list_claims(LocalStorage(root)) == [5, 6]  # 1..4: removed once 4 was persisted
        assert mgr.delete(5)  # gone from both tiers: its claim too
        assert list_claims(LocalStorage(root)) == [6]
    (root / claim_path(2)).write_text('{"kind": "step-claim", "step": 2, "writer": "0badc0de"}')  # a leftover
    report = collect_garbage(LocalStorage(root), min_age_s=0)
    assert claim_path(2) in report.removed_files and claim_path(6) not in report.removed_files
    assert list_claims(LocalStorage(root)) == [6]  # a step only the local tier holds: its claim stays


def test_a_new_job_saves_a_claimed_step_only_after_a_restore_takes_it_over(tmp_path: Path) -> None:
    """Job A committed steps 2 and 3 locally (claimed) and lost its node; job B on a new node
    cannot save step 2 before it restores (A may still be running: two jobs on one root); its
    restore of the newest step takes A's claims over with a warning, and B goes on."""
    root = tmp_path / "root"
    with CheckpointManager(root, local=tmp_path / "a", persist_every=10) as a:
        for step in (1, 2, 3):
            a.save(step, _state(step)).wait()
    shutil.rmtree(tmp_path / "a")
    with CheckpointManager(root, local=tmp_path / "b", persist_every=10) as b:
        with pytest.raises(StepClaimedError, match=r"step 2 of .* is claimed by another writer .*local tier .*/a\b"):
            b.save(2, _state(2, seed=1)).wait()
        assert not (tmp_path / "b" / "step-000000000002" / "manifest.json").exists()
        target = _blank()
        with pytest.warns(UserWarning, match=r"takes over 2 step claim\(s\) above the step it restored: step 2 from"):
            assert b.restore(target) == 1
        b.save(2, _state(2, seed=1)).wait()
        b.save(3, _state(3, seed=1)).wait()


def test_a_step_whose_local_and_persistent_copies_differ_is_not_restored(tmp_path: Path) -> None:
    """Step 1 persisted by this run, and a node directory holding another save's step 1 (a
    disk from another history, or the second of two writers): neither copy is taken as this
    run's. Before, the local copy was restored silently (it is whole, and local wins a tie)."""
    root, node = tmp_path / "root", tmp_path / "node"
    with CheckpointManager(root, local=node, persist_every=1) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.wait_persisted()
    with CheckpointManager(tmp_path / "other", process_group="local") as other:
        other.save(1, _state(1, seed=7)).wait()
    shutil.rmtree(node / "step-000000000001")
    shutil.copytree(tmp_path / "other" / "step-000000000001", node / "step-000000000001")
    for step in (None, 1):
        target = _blank()
        with CheckpointManager(root, local=node) as mgr:
            with pytest.raises(
                CheckpointError, match=r"step 1 is held by the local tier \(node 0 .*different manifests"
            ):
                mgr.restore(target, step=step)
        assert torch.equal(target["w"], _blank()["w"])  # nothing read
    shutil.rmtree(node / "step-000000000001")  # the remedy: the stale local copy goes
    target = _blank()
    with CheckpointManager(root, local=node) as mgr:
        assert mgr.restore(target) == 1 and mgr.last_restore_tier == "persistent"
    assert torch.equal(target["w"], _state(1)["w"])


def test_a_copy_of_a_node_directory_is_another_writer(tmp_path: Path) -> None:
    """Job B's local directory is a copy of job A's (``cp -a``: the same node token): before,
    a claim of A's counted as B's own, both saves of step 3 were acknowledged and A's upload
    later failed. The same directory at its real path is still the same writer."""
    root = tmp_path / "root"
    with CheckpointManager(root, local=tmp_path / "a", persist_every=10) as a:
        a.save(1, _state(1)).wait()
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    with CheckpointManager(root, local=tmp_path / "a", persist_every=10) as a:
        a.save(3, _state(3)).wait()
        with CheckpointManager(root, local=tmp_path / "b", persist_every=10) as b:
            with pytest.raises(StepClaimedError, match=r"step 3 of .* is claimed by another writer"):
                b.save(3, _state(3, seed=1)).wait()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with CheckpointManager(root, local=tmp_path / "link", persist_every=10) as again:  # the same directory
        again.save(4, _state(4)).wait()
