"""What a manager shows of its saves to a tool that drives it (``PreemptionGuard``): the pending
save until its outcome is delivered, the newest step its own saves committed (from memory, not
from the root another writer may share), and with a local tier the two tiers' state."""

from __future__ import annotations

from pathlib import Path

import torch

from shardkeeper.core import CheckpointManager


def test_the_pending_save_and_the_newest_committed_save_follow_the_saves(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        assert (mgr.pending_save, mgr.newest_committed_save, mgr.tiering) == (None, None, None)
        handle = mgr.save(1, {"w": torch.ones(2)})
        assert mgr.pending_save is handle
        handle.wait()
        assert mgr.newest_committed_save == 1
        assert mgr.pending_save is handle  # (ended; its outcome is the manager's to deliver)
        mgr.wait()
        assert mgr.pending_save is None
        with CheckpointManager(root) as other:  # another writer's commit is not this manager's
            other.save(2, {"w": torch.zeros(2)}, async_save=False)
        assert (mgr.newest_committed_save, mgr.latest_step()) == (1, 2)


def test_with_a_local_tier_the_manager_shows_the_two_tiers(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root", local=tmp_path / "local") as mgr:
        mgr.save(3, {"w": torch.ones(2)}, async_save=False)
        assert mgr.newest_committed_save == 3
        assert mgr.tiering is not None  # saves go to the node's directory; the persistent root is the tiers'
        assert (mgr.storage.url, mgr.tiering.persistent.storage.url) == (
            str(tmp_path / "local"),
            str(tmp_path / "root"),
        )
