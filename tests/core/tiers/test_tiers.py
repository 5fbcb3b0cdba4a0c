"""Two tiers across simulated nodes: two torchrun agents (``--nnodes=2``, c10d rendezvous on
loopback), 2 ranks each, each node's local tier its own directory, the persistent tier a
loopback S3 server (moto). A node is lost with a save in flight and its directory deleted;
the restart restores from the other node's copies and replicas, or from S3 without replicas.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.testing.procs import kill_tree
from tests.checks import assert_checks, read_checks
from tests.launch import WORKER_MAIN

WORKER = Path(__file__).parents[1] / "dist" / "tier_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agents(
    nodes: list[int], mode: str, out: Path, cfg: dict[str, Any], per_node: int = 2
) -> list[subprocess.Popen[str]]:
    """One torchrun agent per entry of ``nodes`` (its local directory's index), ``per_node`` ranks each."""
    port = _free_port()
    procs = []
    for i, node in enumerate(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(nodes)}",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=tiers",
            "--max-restarts=0",
            "--local-addr=127.0.0.1",
            str(WORKER_MAIN),
            str(WORKER),
            mode,
            str(out),
            json.dumps(cfg),
        ]
        env = {**os.environ, "TIER_NODE": str(node), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(out.parent / f"{out.name}-agent{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        )
        log.close()
    return procs


def _logs(out: Path) -> str:
    return "\n".join(p.read_text()[-6000:] for p in sorted(out.parent.glob(f"{out.name}-agent*.log")))


def _run_until(procs: list[subprocess.Popen[str]], out: Path, done: Any, timeout_s: float) -> None:
    """Wait for ``done()`` (or every agent's clean exit when None), then kill every agent's tree."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if done is not None and done():
                return
            if done is None and all(p.poll() is not None for p in procs):
                codes = [p.returncode for p in procs]
                assert codes == [0] * len(procs), f"agents exited with {codes}:\n{_logs(out)}"
                return
            if done is not None and any(p.poll() not in (None, 0) for p in procs) and not done():
                time.sleep(2)  # a killed node's agent exits non-zero: give the markers a moment
                if not done():
                    raise AssertionError(f"an agent failed before the markers:\n{_logs(out)}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s} s:\n{_logs(out)}")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
            p.wait(timeout=30)


def _save_phase(tmp: Path, nodes: list[int], cfg: dict[str, Any]) -> None:
    out = tmp / "save"
    out.mkdir()
    world = 2 * len(nodes)
    procs = _agents(nodes, "save", out, cfg)

    def done() -> bool:
        return len(list(out.glob("killed-r*"))) + len(list(out.glob("waiting-r*"))) == world

    _run_until(procs, out, done, 240)
    assert_checks(read_checks(*(out / f"save-r{r}.json" for r in range(world)), output=_logs(out)))


def _resume_phase(tmp: Path, nodes: list[int], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = tmp / "resume"
    out.mkdir()
    _run_until(_agents(nodes, "resume", out, cfg), out, None, 240)
    world = 2 * len(nodes)
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(world)), output=_logs(out)))
    return [json.loads((out / f"resume-r{r}.json").read_text()) for r in range(world)]


def _config(tmp: Path, s3_root: tuple[str, dict[str, Any]], **over: Any) -> dict[str, Any]:
    url, options = s3_root
    return {
        "root": url,
        "storage_options": options,
        "locals": [str(tmp / "node0"), str(tmp / "node1")],
        "commit_timeout_s": 20,
        **over,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_lost_node_restores_from_peers_without_reading_s3(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    cfg = _config(tmp_path, s3_root, steps=5, persist_every=3, replicas=1, expect_persisted=[1, 4], kill_node=1)
    cfg["incremental"] = True  # unchanged tensors point at step 1's files, on both nodes
    _save_phase(tmp_path, [0, 1], cfg)
    assert not any((tmp_path / "node0").glob("step-000000000006/manifest.json"))
    shutil.rmtree(tmp_path / "node1")  # the node is replaced by an empty one
    got = _resume_phase(tmp_path, [0, 1], cfg)
    assert [g["step"] for g in got] == [5] * 4, got
    assert [g["tier"] for g in got] == ["local"] * 4, got
    assert [g["persistent_reads"] for g in got] == [0] * 4, got
    # the new node's copy was made whole from node 0's copies and replicas
    assert (tmp_path / "node1" / "step-000000000005" / "manifest.json").exists()
    ours = sorted(p.name for p in (tmp_path / "node0" / "step-000000000005" / "data").iterdir())
    theirs = sorted(p.name for p in (tmp_path / "node1" / "step-000000000005" / "data").iterdir())
    assert ours == theirs and len(ours) >= 4, (ours, theirs)
    # and the files of step 1 that step 5 points at (incremental), not the rest of step 1
    pointed = sorted(p.name for p in (tmp_path / "node1" / "step-000000000001" / "data").iterdir())
    assert pointed and set(pointed) <= {p.name for p in (tmp_path / "node0" / "step-000000000001" / "data").iterdir()}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_without_replicas_a_lost_node_falls_back_to_s3(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    cfg = _config(tmp_path, s3_root, steps=5, persist_every=3, replicas=0, expect_persisted=[1, 4], kill_node=1)
    _save_phase(tmp_path, [0, 1], cfg)
    shutil.rmtree(tmp_path / "node1")
    got = _resume_phase(tmp_path, [0, 1], cfg)
    assert [g["step"] for g in got] == [4] * 4, got
    assert [g["tier"] for g in got] == ["persistent"] * 4, got
    assert all(g["persistent_reads"] > 0 for g in got), got
    # node 0's step 5 is dropped: no tier holds it whole, and a save there would be refused
    assert not (tmp_path / "node0" / "step-000000000005").exists()


def _flip_own_chunk(node_dir: Path, step: int, rank: int) -> Path:
    """Flip a byte inside rank ``rank``'s per-rank tensor in ``node_dir``'s copy of ``step``
    (a chunk only that rank restores, so its own node's copy is the one read); the file."""
    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.storage import LocalStorage

    leaves = load_manifest(LocalStorage(node_dir), step).leaves
    key = next(k for k in leaves if k.startswith("own") and k.rstrip("/").endswith(f"/{rank}"))
    chunk = leaves[key].chunks[0]
    path = node_dir / f"step-{step:012d}" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_damaged_copy_is_replaced_by_another_nodes_good_one(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    """A flipped byte in one node's copy does not cost the step while another node holds a
    good copy: the copy is replaced from it and the step restored, bit for bit."""
    from shardkeeper.core.storage import LocalStorage
    from shardkeeper.core.verify.step import verify_step

    cfg = _config(tmp_path, s3_root, steps=3, persist_every=None, replicas=1, expect_persisted=[])
    _save_phase(tmp_path, [0, 1], cfg)  # no node is lost: step 4 commits on both nodes
    damaged = {0: _flip_own_chunk(tmp_path / "node0", 4, 0), 1: _flip_own_chunk(tmp_path / "node1", 4, 2)}
    for node, path in damaged.items():  # damage the digests see, in one node's copy only
        assert not verify_step(LocalStorage(tmp_path / f"node{node}"), 4).ok
        other = tmp_path / f"node{1 - node}" / path.relative_to(tmp_path / f"node{node}")
        assert other.read_bytes() != path.read_bytes()
    # and a directory made where node 0 held one of rank 1's files: replaced too
    gone = sorted((tmp_path / "node0" / "step-000000000004" / "data").glob("r00001-*"))[-1]
    gone.unlink()
    gone.mkdir()
    got = _resume_phase(tmp_path, [0, 1], cfg)
    assert [g["step"] for g in got] == [4] * 4, got  # not step 3: nothing was lost
    assert [g["tier"] for g in got] == ["local"] * 4, got
    assert [g["persistent_reads"] for g in got] == [0] * 4, got
    for node, path in damaged.items():
        other = tmp_path / f"node{1 - node}" / path.relative_to(tmp_path / f"node{node}")
        assert path.read_bytes() == other.read_bytes()
        assert verify_step(LocalStorage(tmp_path / f"node{node}"), 4).ok
    assert (
        gone.is_file() and gone.read_bytes() == (tmp_path / "node1" / gone.relative_to(tmp_path / "node0")).read_bytes()
    )
    logs = _logs(tmp_path / "resume")
    assert "replaced by other nodes' good copies" in logs and "is damaged; replacing it with node" in logs, logs
    assert f"{gone.name} in {tmp_path / 'node0'} is" in logs and "expected); replacing it with node 1's copy" in logs


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_nodes_holding_different_manifests_of_the_newest_step_refuse_it_by_name(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    """An old disk back after a rollback: two valid manifests of one step. Neither is trusted
    over the other: the restore raises on every rank, naming both, and nothing is removed."""
    cfg = _config(tmp_path, s3_root, steps=3, persist_every=None, replicas=1, expect_persisted=[])
    _save_phase(tmp_path, [0, 1], cfg)  # step 4 commits on both nodes
    theirs = tmp_path / "node1" / "step-000000000004" / "manifest.json"
    doc = json.loads(theirs.read_text())
    doc["created_at"] = "2000-01-01T00:00:00Z"  # still valid; another commit's manifest
    theirs.write_text(json.dumps(doc))
    out = tmp_path / "conflict"
    out.mkdir()
    _run_until(_agents([0, 1], "conflict", out, cfg), out, None, 240)
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(4)), output=_logs(out)))
    assert (tmp_path / "node0" / "step-000000000004" / "manifest.json").exists() and theirs.exists()
    assert json.loads(theirs.read_text())["created_at"] == "2000-01-01T00:00:00Z"
    assert (tmp_path / "node0" / "step-000000000003" / "manifest.json").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_one_node_run_resumes_on_two_nodes(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    cfg = _config(tmp_path, s3_root, steps=3, persist_every=None, replicas=1, expect_persisted=[])
    _save_phase(tmp_path, [0], cfg)
    got = _resume_phase(tmp_path, [0, 1], {**cfg, "per_rank": "modulo", "saved_world": 2})
    assert [g["step"] for g in got] == [4] * 4, got  # the last save (step 4) was waited for
    assert [g["tier"] for g in got] == ["local"] * 4, got
    assert [g["persistent_reads"] for g in got] == [0] * 4, got


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_rank_that_cannot_write_fails_every_rank_at_once(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    cfg = _config(tmp_path, s3_root, replicas=1, commit_timeout_s=120)
    out = tmp_path / "faults"
    out.mkdir()
    _run_until(_agents([0, 1], "faults", out, cfg), out, None, 300)
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(4)), output=_logs(out)))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tier_options_that_differ_between_nodes_are_refused(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    cfg = _config(tmp_path, s3_root, commit_timeout_s=120)
    out = tmp_path / "mismatch"
    out.mkdir()
    _run_until(_agents([0, 1], "mismatch", out, cfg), out, None, 300)
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(4)), output=_logs(out)))
