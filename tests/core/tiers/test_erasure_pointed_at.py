"""An incremental step whose files point at an earlier step's survives the loss of a node
under erasure=(3, 1) (four simulated nodes, a process each, forked as the tier campaign's).

Only ranks 0 and 2 hold a tensor that never changes: steps 2-4 point at step 1's files of
nodes 0 and 2. With ``local_keep=2`` retention deletes step 1, but keeps those files; the
files of nodes 1 and 3 go. Before, the parity of step 1 went too (its holder, node 3, no
longer held step 1's directory), and so did node 1's step-1 file, without which the group's
parity rebuilds nothing: node 0 lost, the acknowledged step 4 was removed from every node and
the persisted step 1 restored from the persistent root."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardkeeper.core.testing.tier_campaign import free_port, launch_nodes
from shardkeeper.core.testing.tier_node import Launch


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_lost_node_of_a_step_pointing_at_an_earlier_one_is_rebuilt(tmp_path: Path) -> None:
    nodes = [str(tmp_path / f"node{i}") for i in range(4)]
    logs = tmp_path / "logs"
    logs.mkdir()
    opts = {"incremental": True, "local_keep": 2, "persist_every": 100}
    save = Launch(0, str(tmp_path / "root"), {}, nodes, (3, 1), free_port(), 4, 64 << 10, {}, manager_options=opts)
    ran = launch_nodes(save, logs, 0, None, 0.1, 100.0, False)
    assert ran.acked == {1, 2, 3, 4} and not ran.said, (ran, (logs / "launch000-r0.log").read_text()[-3000:])
    shutil.rmtree(nodes[0])  # node 0 replaced by an empty one
    versions = dict.fromkeys(range(1, 5), 0)
    restore = Launch(1, save.root, {}, nodes, (3, 1), free_port(), 0, 64 << 10, versions, manager_options=opts)
    ran = launch_nodes(restore, logs, 0, None, 0.1, 100.0, False)
    log = (logs / "launch001-r0.log").read_text()[-4000:]
    assert [r and r["restored"] for r in ran.reports] == [4] * 4, (ran.reports, log)
    assert [r["tier"] for r in ran.reports if r] == ["local"] * 4, (ran.reports, log)
    assert [r["persistent_reads"] for r in ran.reports if r] == [0] * 4, ran.reports
    assert all(r and r["exact"] for r in ran.reports), ran.reports
