"""The erasure-coded node tier across four simulated nodes (4 gloo ranks, a local directory
each; ``dist/erasure_worker.py``): parity lies on the nodes the placement names, a node
replaced by an empty one (XOR), or two of a group (Reed-Solomon, m=2), or a byte flipped in
a node's data file, is rebuilt from parity and the newest step restores bit for bit with no
read from the persistent root, and more losses than parity fall back to the persisted step."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers


def _run(
    tmp_path: Path, name: str, mode: str, erasure: list[int], lose: list[int], parity: list[list[str]]
) -> dict[str, Any]:
    base = tmp_path / name
    return {
        "name": name,
        "mode": mode,
        "root": str(base / "root"),
        "locals": [str(base / f"node{r}") for r in range(4)],
        "erasure": erasure,
        "lose": lose,
        "parity": parity,
    }


def _names(*held: str) -> list[str]:
    return sorted(n for h in held for n in (h, h + ".json"))


def _launch(tmp_path: Path, runs: list[dict[str, Any]], env: dict[str, str] | None = None) -> str:
    """Run ``runs`` on 4 ranks, assert every check passed; the launch's output."""
    out = tmp_path / "out"
    res = run_workers(4, "erasure_worker.py", str(out), json.dumps(runs), timeout_s=150, env=env)
    assert res.returncode == 0, res.stdout[-8000:]
    for run in runs:
        checks = read_checks(*(out / run["name"] / f"checks-r{r}.json" for r in range(4)), output=res.stdout)
        assert_checks(checks)
    return res.stdout


def _pairs(tmp_path: Path) -> dict[str, Any]:
    """Two nodes of two ranks each, erasure=(1, 1): each node's parity on the other; node 1 lost."""
    run = _run(tmp_path, "pairs", "rebuild", [1, 1], [1], [_names("g1-p0"), _names("g0-p0")])
    return {**run, "per_node": 2, "locals": run["locals"][:2]}


#: Where erasure=(3, 1) puts the parity of 4 nodes' ~4.6 MiB (2 pieces): group [0, 1, 2]'s on
#: node 3, group [3]'s two pieces on nodes 0 and 1.
XOR = [_names("g1-p0"), _names("g1-p0"), [], _names("g0-p0")]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_lost_nodes_are_rebuilt_from_parity_with_no_persistent_read(tmp_path: Path) -> None:
    """Before the rebuild, both restores fell back to the persisted step 1 (reading S3's copy)."""
    _launch(
        tmp_path,
        [
            # groups [0, 1, 2] (parity on 3) and [3] (its 2 pieces of parity on 0 and 1); node 3 lost
            _run(tmp_path, "xor", "rebuild", [3, 1], [3], XOR),
            # groups [0, 1] (parity on 2, 3) and [2, 3] (parity on 0, 1); nodes 0 and 1 lost
            _run(
                tmp_path,
                "rs",
                "rebuild",
                [2, 2],
                [0, 1],
                [_names("g1-p0"), _names("g1-p1"), _names("g0-p0"), _names("g0-p1")],
            ),
            # two nodes of two ranks (their files one stream per node): groups [0] and [1], each
            # one's parity on the other; node 1 lost
            _pairs(tmp_path),
            _flipped(tmp_path),
        ],
    )


def _flipped(tmp_path: Path) -> dict[str, Any]:
    """erasure=(2, 1), nothing lost, a byte flipped in node 1's and node 3's step-3 data files
    (groups [0, 1] and [2, 3]): each damaged copy is rebuilt from its group's parity as if
    its node were lost. Before, the restore spread node 1's damaged file to every node
    unchecked, found no good copy, fell back to step 2 and removed step 3 from every node."""
    run = _run(tmp_path, "flipped", "rebuild", [2, 1], [], [_names("g1-p0")] * 2 + [_names("g0-p0")] * 2)
    run["harm"] = [[n, f"step-000000000003/data/r0000{n}-*.safetensors", "flip"] for n in (1, 3)]
    return {**run, "ls": "whole"}  # (ls judges by sizes)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_encrypted_incremental_step_rebuilds_and_damaged_parity_or_more_losses_fall_back(tmp_path: Path) -> None:
    """A damaged parity piece fails its digest: the rebuild goes to the step before (before,
    the rebuild's failure failed the whole restore)."""
    pytest.importorskip("cryptography")
    pytest.importorskip("zstandard")
    codecs = _run(tmp_path, "codecs", "rebuild", [3, 1], [2], XOR)
    # incremental: steps 2 and 3 point at step 1's files for an unchanged tensor, which are
    # rebuilt from step 1's parity too (before, the step fell back to the persisted step 1)
    codecs["options"] = {"encryption": "env:SK_ERASURE_KEK", "compression": "zstd", "incremental": True}
    # two of group [0, 1, 2] lost, one parity shard: the persisted step 1
    # node 1 lost and node 3's parity of step 3 damaged: step 2, rebuilt
    damaged = _run(tmp_path, "damaged", "damaged", [3, 1], [1], XOR)
    damaged["damage"] = [3, "g0-p0"]
    over = _run(tmp_path, "over", "fallback", [3, 1], [0, 1], XOR)
    # node 1's step-3 data file lost and the record edited to name its step-2 file: nothing is
    # written over that file (before, the rebuild wrote step 3's bytes over it and lost step 2)
    redirected = _run(tmp_path, "redirected", "redirected", [3, 1], [], XOR)
    redirected["redirect"] = True
    output = _launch(
        tmp_path,
        [codecs, damaged, redirected, over],
        env={"SK_ERASURE_KEK": base64.b64encode(bytes(range(32))).decode()},
    )
    # the warning names the node, its directory and the parity file (before: only the piece)
    where = damaged["locals"][3]
    want = f"held by node 3 (rank 3, {where}) in .parity/step-000000000003/g0-p0, fails its recorded digest"
    assert want in output, output[-6000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_more_losses_than_parity_name_the_steps_group_and_lost_nodes(tmp_path: Path) -> None:
    """Nodes 0 and 1 of group [0, 1, 2] lost, one parity shard: the warning of the fallback to
    the persisted step, and the error when nothing was uploaded, name the steps, the group,
    each lost node with its rank and directory, and the remedy (before, only the steps
    removed and the roots were named)."""
    over = _run(tmp_path, "over", "fallback", [3, 1], [0, 1], XOR)
    nothing = _run(tmp_path, "nothing", "nothing", [3, 1], [0, 1], XOR)
    nothing["persist_every"] = None
    said = [
        "group 0 (nodes 0, 1, 2) lost node 0 (rank 0, {0}) and node 1 (rank 1, {1}); erasure=(3, 1) rebuilds at "
        "most 1 lost node(s) of a group",
        "put the lost nodes' directories back as they were",
        "pass a larger m in erasure=(k, m)",
    ]
    nothing["said"] = ["steps 1, 2, 3 lost more nodes than parity rebuilds"] + [
        w.format(*nothing["locals"]) for w in said
    ]
    # node 1 lost; node 3's parity of step 3 cut short, a byte of node 0's step-2 file flipped:
    # step 1 is rebuilt. The warnings name the damaged parity file (before: "its parity on
    # node 3" was called lost) and the files step 2 was decoded from (before: only the rebuilt ones)
    harmed = _run(tmp_path, "harmed", "damaged", [3, 1], [1], XOR)
    harmed.update(restored=1, ls="partial")
    harmed["harm"] = [
        [3, ".parity/step-000000000003/g0-p0", "cut"],
        [0, "step-000000000002/data/r00000-*.safetensors", "flip"],
    ]
    # node 1 lost and node 3's .parity a symbolic link: its parity is named unreadable, with
    # the link (before: called lost, with the remedy to put the lost directories back)
    # then a save that fails for the link leaves no parity of it on the other nodes, and a
    # killed save's parity is removed at the next commit (before: both stayed)
    linked = _run(tmp_path, "linked", "linked", [3, 1], [1], XOR)
    linked.update(link=3, ls="partial")
    output = _launch(tmp_path, [over, nothing, harmed, linked])
    want = "and its parity on node 3 (rank 3, {3}) unreadable: {3}/.parity is a symbolic link to "
    assert want.format(*linked["locals"]) in output, output[-8000:]
    for want in ["steps 1, 2, 3 lost more nodes than parity rebuilds"] + [w.format(*over["locals"]) for w in said]:
        assert want in output, output[-6000:]
    for want in [
        "step 3 lost more nodes than parity rebuilds (group 0 (nodes 0, 1, 2) lost node 1 (rank 1, {1}), and its "
        "parity on node 3 (rank 3, {3}) damaged: {3}/.parity/step-000000000003/g0-p0 holds ",
        "step 2: the files rebuilt from parity on {1} fail the manifest's digests",
        "decoded from these files, one of which may be damaged: node 0 (rank 0, {0}): step-000000000002/data/r00000-",
    ]:
        assert want.format(*harmed["locals"]) in output, output[-8000:]
