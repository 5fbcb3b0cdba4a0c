"""Two tiers in one process: the options' refusals, where replicas go, the local commit and
its retention, the upload to the persistent root and a failed one, restore from each tier,
and the codecs through both tiers (the multi-node behaviour: ``tests/core/tiers/test_tiers.py``)."""

from __future__ import annotations

import base64
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch

from shardkeeper.core import CheckpointManager, CheckpointSaveError
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.faults import FaultyStorage
from shardkeeper.core.tiers.nodes import NODE_TOKEN, NodeMap
from shardkeeper.core.tiers.tiering import writer_rank


def test_replicas_go_to_other_nodes_and_spread_over_their_ranks() -> None:
    nodes = NodeMap(((0, 1), (2, 3), (4, 5)))
    assert nodes.targets(0, 1) == [2] and nodes.targets(1, 1) == [3] and nodes.targets(5, 1) == [1]
    assert nodes.targets(0, 2) == [2, 4]
    assert nodes.targets(0, 5) == [2, 4]  # never more than the other nodes
    assert nodes.sources(2, 1) == [0] and nodes.sources(0, 2) == [2, 4]
    uneven = NodeMap(((0, 1, 2), (3,)))
    assert [uneven.targets(r, 1) for r in range(4)] == [[3], [3], [3], [0]]
    assert uneven.sources(3, 1) == [0, 1, 2]
    assert uneven.is_leader(3) and not uneven.is_leader(2) and uneven.node_of(2) == 0
    assert writer_rank("step-000000000001/data/r00012-ab12cd34-000.safetensors") == 12
    assert writer_rank("step-000000000001/manifest.json") is None


def test_tier_options_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="configure the local tier; pass local="):
        CheckpointManager(tmp_path / "p", persist_every=2)
    with pytest.raises(ValueError, match="not a URL"):
        CheckpointManager(tmp_path / "p", local="s3://bucket/x")
    with pytest.raises(ValueError, match="describe_layouts=True"):
        CheckpointManager(tmp_path / "p", local=tmp_path / "l", describe_layouts=True)
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        CheckpointManager(tmp_path / "p", local=tmp_path / "l", replicas=-1)
    with pytest.raises(TypeError, match="replicas must be an int >= 0"):
        CheckpointManager(tmp_path / "p", local=tmp_path / "l", replicas="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="persist_every must be >= 1"):
        CheckpointManager(tmp_path / "p", local=tmp_path / "l", persist_every=0)
    assert not (tmp_path / "p").exists() and not (tmp_path / "l").exists()  # nothing touched


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory in RAM where the machine has one (the local tier of a process restart)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        pytest.skip("no writable /dev/shm")
    path = base / f"shardkeeper-test-{uuid.uuid4().hex}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").exists())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_local_commit_upload_retention_and_restore_from_each_tier(
    tmp_path: Path, shm: Path, writer: Literal["thread", "process"], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``writer="process"`` the persist process writes, commits, uploads and retains, and
    the trainer hears of the uploads over the channel (``persisted_steps``, ``wait_persisted``)."""
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    persistent = tmp_path / "persistent"
    with pytest.warns(UserWarning, match="replicas=1 asked, but the job's ranks share 1 local directory"):
        mgr = CheckpointManager(
            persistent, local=shm, persist_every=2, local_keep=2, keep_last=2, replicas=1, writer=writer
        )
    with mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
            mgr.wait_persisted()
        assert mgr.persisted_steps == [1, 3, 5]
        assert mgr.steps() == [3, 4, 5]  # this node: 4, 5; the persistent root: 3, 5 (keep_last=2)
    assert _steps(shm) == [4, 5]  # local_keep=2
    assert _steps(persistent) == [3, 5]  # keep_last=2 on the persistent root
    assert (shm / NODE_TOKEN).exists()
    # a restarted process restores from RAM, reading nothing from the persistent root
    target = {k: torch.zeros_like(v) for k, v in _state(5).items()}
    with CheckpointManager(persistent, local=shm, writer=writer) as mgr:
        assert mgr.restore(target) == 5
        assert mgr.last_restore_tier == "local" and mgr.persistent_reads == 0
        assert mgr.restore(target, step=3) == 3  # only in the persistent root
        assert mgr.last_restore_tier == "persistent" and mgr.persistent_reads > 0
        assert all(torch.equal(target[k], v) for k, v in _state(3).items())
    # the local tier lost: the newest persisted step
    shutil.rmtree(shm)
    with CheckpointManager(persistent, local=shm) as mgr:
        assert mgr.restore(target) == 5 and mgr.last_restore_tier == "persistent"
    assert all(torch.equal(target[k], v) for k, v in _state(5).items())


def test_a_newer_persisted_step_wins_and_the_stale_local_one_is_dropped(tmp_path: Path) -> None:
    persistent, local, other = tmp_path / "p", tmp_path / "l", tmp_path / "l2"
    with CheckpointManager(persistent, local=local, persist_every=1) as mgr:
        mgr.save(1, _state(1))
    with CheckpointManager(persistent, local=other, persist_every=1) as mgr:  # another machine went on
        mgr.restore({k: torch.zeros_like(v) for k, v in _state(1).items()})
        mgr.save(2, _state(2))
    with CheckpointManager(persistent, local=local) as mgr:
        target = {k: torch.zeros_like(v) for k, v in _state(2).items()}
        assert mgr.restore(target) == 2 and mgr.last_restore_tier == "persistent"
        mgr.save(3, _state(3))  # the local tier takes saves after the persisted step
    assert _steps(local) == [1, 3]


def test_codecs_go_through_both_tiers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cryptography")
    pytest.importorskip("zstandard")
    monkeypatch.setenv("SK_TIER_KEK", base64.b64encode(bytes(range(32))).decode())
    opts = {"encryption": "env:SK_TIER_KEK", "compression": "zstd"}
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, persist_every=1, **opts) as mgr:  # type: ignore[arg-type]
        mgr.save(7, _state(7))
    data = next((local / "step-000000000007" / "data").iterdir()).read_bytes()
    assert data == next((persistent / "step-000000000007" / "data").iterdir()).read_bytes()  # uploaded as is
    for where in (local, persistent):
        target = {k: torch.zeros_like(v) for k, v in _state(7).items()}
        if where is persistent:
            shutil.rmtree(local)
        with CheckpointManager(persistent, local=local, **opts) as mgr:  # type: ignore[arg-type]
            assert mgr.restore(target) == 7
        assert all(torch.equal(target[k], v) for k, v in _state(7).items())
    with CheckpointManager(persistent) as mgr, pytest.raises(Exception, match="encrypted"):
        mgr.restore({k: torch.zeros_like(v) for k, v in _state(7).items()})


def test_a_failed_upload_is_raised_and_the_next_save_is_uploaded_instead(tmp_path: Path) -> None:
    persistent = FaultyStorage(LocalStorage(tmp_path / "p"), fail_on={"open_writer": "*/data/*"}, times=1)
    mgr = CheckpointManager(persistent, local=tmp_path / "l", persist_every=3)
    mgr.save(1, _state(1))
    with pytest.raises(CheckpointSaveError, match=r"step 1 was not uploaded to .*injected fault.*local tier only"):
        mgr.wait_persisted()
    mgr.wait_persisted()  # raised once
    assert mgr.persisted_steps == [] and mgr.is_committed(1)
    mgr.save(2, _state(2))  # due at once (not 3 steps later): the failed upload does not count
    mgr.save(3, _state(3))  # not due: 2 is being (or was) uploaded
    mgr.close()
    assert mgr.persisted_steps == [2]
    assert _steps(tmp_path / "l") == [1, 2, 3] and _steps(tmp_path / "p") == [2]


def test_a_local_copy_damaged_before_its_upload_is_not_persisted(tmp_path: Path) -> None:
    """The persistent root is the tier of last resort: an upload checks the local bytes it
    sends (here a file of step 2, which the incremental step 3 points at, damaged on disk)."""
    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.verify.step import verify_step

    persistent, local = tmp_path / "p", tmp_path / "l"

    def state(step: int) -> dict[str, torch.Tensor]:
        return {**_state(step), "x": torch.full((4096,), float(min(step, 2)))}  # the same from step 2 on

    mgr = CheckpointManager(persistent, local=local, persist_every=2, incremental=True)
    mgr.save(1, state(1))  # uploaded
    mgr.wait_persisted()
    mgr.save(2, state(2))  # not due
    mgr.wait()
    chunk = load_manifest(LocalStorage(local), 2).leaves["x"].chunks[0]
    f = local / "step-000000000002" / chunk.file
    data = bytearray(f.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    mgr.save(3, state(3))  # due; its "x" points at step 2's damaged file
    with pytest.raises(CheckpointSaveError, match=r"step 3 was not uploaded.*copy of step 3 .* is damaged"):
        mgr.wait_persisted()
    mgr.close()
    assert _steps(persistent) == [1] and verify_step(LocalStorage(persistent), 1).ok
    assert not (persistent / "step-000000000002").exists()  # nothing of the damaged file went up


def test_ls_shows_which_tiers_hold_each_step(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    persistent, a, b = tmp_path / "p", tmp_path / "a", tmp_path / "b"
    with CheckpointManager(persistent, local=a, persist_every=2, min_file_bytes=1) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    shutil.copytree(a, b)  # a second node's directory with the same steps
    files = sorted((a / "step-000000000002" / "data").iterdir())
    assert len(files) >= 2
    files[0].unlink()  # node a lost one file of step 2, node b another: together still whole
    (b / "step-000000000002" / "data" / files[1].name).unlink()

    def ls(*local: Path) -> dict[str, dict]:
        cmd = [sys.executable, "-m", "shardkeeper.core.cli", "ls", str(persistent), "--json"]
        out = subprocess.run([*cmd, *(f"--local={d}" for d in local)], capture_output=True, text=True, check=True)
        return {str(r["step"]): r for r in json.loads(out.stdout)["steps"]}

    rows = ls(a, b)
    assert rows["1"]["tiers"] == ["persistent", "local:0", "local:1"] and rows["1"]["local_whole"] is True
    assert rows["2"]["status"] == "local" and rows["2"]["tiers"] == ["local:0", "local:1"]
    assert rows["2"]["local_whole"] is True
    # a step only the local tier holds shows its manifest's figures, as a persisted one does
    assert rows["2"]["leaves"] == rows["1"]["leaves"] == 2 and rows["2"]["world_size"] == 1
    assert rows["2"]["size_bytes"] == rows["1"]["size_bytes"] > 0 and rows["2"]["created_at"]
    assert ls(a)["2"]["local_whole"] is False  # one node alone lacks a file
    text = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.cli", "ls", str(persistent), f"--local={a}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "TIERS" in text and "local:0 (partial)" in text and "persistent,local:0 (whole)" in text
    assert not rows["1"]["local_conflict"] and not rows["2"]["local_conflict"]
    theirs = b / "step-000000000001" / "manifest.json"  # another history's manifest of step 1
    theirs.write_text(theirs.read_text().replace('"created_at":"', '"created_at":"1999', 1))
    assert ls(a, b)["1"]["local_conflict"] is True


def _flip_a_byte(step_dir: Path) -> None:
    f = max((step_dir / "data").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_repair_judges_a_copy_good_only_when_its_bytes_checked_out(tmp_path: Path) -> None:
    """What a node reports of its copies when a repair asks (a source must have been read)."""
    from types import SimpleNamespace

    from shardkeeper.core.tiers.repair import ABSENT, BAD, GOOD, UNKNOWN, check_copies

    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, min_file_bytes=1) as mgr:
        mgr.save(1, _state(1))
    data = local / "step-000000000001" / "data"
    files = sorted(p.name for p in data.iterdir() if p.suffix == ".safetensors")
    assert len(files) >= 2
    _flip_a_byte(local / "step-000000000001")
    flipped = max(data.iterdir(), key=lambda p: p.stat().st_size).name
    intact = next(f for f in files if f != flipped)
    (data / "stray.bin").write_bytes(b"not in the manifest")
    paths = [f"step-000000000001/data/{n}" for n in (flipped, intact, "stray.bin", "gone.safetensors")]
    store = LocalStorage(local)
    got = check_copies(SimpleNamespace(raw=store, read=store), 1, paths)
    assert [got[p][0] for p in paths] == [BAD, GOOD, UNKNOWN, ABSENT], got
    assert got[paths[1]][1] == (data / intact).stat().st_size


def test_a_damaged_local_copy_falls_back_to_the_persistent_one(tmp_path: Path) -> None:
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, persist_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    _flip_a_byte(local / "step-000000000002")  # same size: the listing takes it for whole
    target = {k: torch.zeros_like(v) for k, v in _state(2).items()}
    with CheckpointManager(persistent, local=local) as mgr:
        with pytest.warns(UserWarning, match="step 2 in the local tier is damaged"):
            assert mgr.restore(target) == 2
        assert mgr.last_restore_tier == "persistent"
    assert all(torch.equal(target[k], v) for k, v in _state(2).items())


def test_the_fallback_warning_does_not_call_the_target_partly_restored(tmp_path: Path) -> None:
    """The failed read wrote some keys, but the restore that follows rewrites them all: the
    warning names the damage, not "do not train from it"."""
    persistent, local = tmp_path / "p", tmp_path / "l"

    def state(step: int) -> dict[str, torch.Tensor]:
        return {**_state(step), **{f"k{i}": torch.full((1000,), float(step + i)) for i in range(8)}}

    with CheckpointManager(persistent, local=local, persist_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    _flip_a_byte(local / "step-000000000002")
    target = {k: torch.zeros_like(v) for k, v in state(2).items()}
    with CheckpointManager(persistent, local=local) as mgr:
        with pytest.warns(UserWarning, match="step 2 in the local tier is damaged") as said:
            assert mgr.restore(target) == 2
    assert all(torch.equal(target[k], v) for k, v in state(2).items())
    assert not any("do not train from it" in str(w.message) for w in said), [str(w.message) for w in said]


def test_a_damaged_newer_persisted_step_yields_to_the_newest_whole_local_one(tmp_path: Path) -> None:
    persistent, a, b = tmp_path / "p", tmp_path / "a", tmp_path / "b"
    with CheckpointManager(persistent, local=a, persist_every=10) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    assert _steps(persistent) == [1]
    with CheckpointManager(persistent, local=b, persist_every=1) as mgr:  # another run went on to step 4
        mgr.restore({k: torch.zeros_like(v) for k, v in _state(1).items()})
        mgr.save(4, _state(4))
    _flip_a_byte(persistent / "step-000000000004")
    target = {k: torch.zeros_like(v) for k, v in _state(3).items()}
    with CheckpointManager(persistent, local=a) as mgr, warnings_of() as caught:
        assert mgr.restore(target) == 3
        assert mgr.last_restore_tier == "local"
    assert any("restoring step 3, whole in the local tier, instead" in str(w.message) for w in caught)
    assert all(torch.equal(target[k], v) for k, v in _state(3).items())
    assert _steps(a) == [1, 2, 3]  # the whole local steps stay


def test_saves_below_a_persisted_step_are_refused_and_delete_covers_both_tiers(tmp_path: Path) -> None:
    from shardkeeper.core import StepOrderError

    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    assert _steps(persistent) == [1, 3]
    shutil.rmtree(local)
    with CheckpointManager(persistent, local=local) as mgr:
        assert mgr.restore({k: torch.zeros_like(v) for k, v in _state(1).items()}, step=1) == 1
        with pytest.raises(StepOrderError, match="below the newest committed step 3") as refused:
            mgr.save(2, _state(2))
        assert str(persistent) in str(refused.value) and str(local) not in str(refused.value)  # where step 3 is
        mgr.save(4, _state(4))
        mgr.wait()
        assert not mgr.delete(3)  # the persistent root's newest: kept, as without tiers
        assert mgr.delete(1) and _steps(persistent) == [3]
        assert not mgr.delete(4)  # the newest, in the local tier: kept
        with pytest.raises(ValueError, match="whole in the local tiers"):
            mgr.delete(4, damaged=True)
        (local / "step-000000000004" / "data").rename(local / "gone")  # now it is damaged
        assert mgr.delete(4, damaged=True) and _steps(local) == []


def warnings_of():  # type: ignore[no-untyped-def]
    import warnings

    return warnings.catch_warnings(record=True)


def test_a_local_directory_belongs_to_one_root(tmp_path: Path) -> None:
    from shardkeeper.core import CheckpointError

    local = tmp_path / "l"
    with CheckpointManager(tmp_path / "a", local=local) as mgr:
        mgr.save(1, _state(1))
    with pytest.raises(CheckpointError, match=r"holds the local tier of the root .*/a', not of .*/b'"):
        CheckpointManager(tmp_path / "b", local=local)  # a new job beside old node directories
    for bad in (tmp_path / "a", tmp_path / "a" / "local"):
        with pytest.raises(ValueError, match="the local tier is a directory of its own"):
            CheckpointManager(tmp_path / "a", local=bad)
    with pytest.raises(ValueError, match="around the root"):
        CheckpointManager(tmp_path / "a" / "inner", local=tmp_path / "a")


def test_a_damaged_newest_local_step_yields_to_an_older_whole_one_and_is_dropped(tmp_path: Path) -> None:
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, persist_every=10) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    _flip_a_byte(local / "step-000000000003")
    target = {k: torch.zeros_like(v) for k, v in _state(2).items()}
    with CheckpointManager(persistent, local=local) as mgr:
        with pytest.warns(
            UserWarning, match="step 3 in the local tier is damaged .*restoring step 2 of the local tier"
        ):
            assert mgr.restore(target) == 2
        assert mgr.last_restore_tier == "local"
        assert _steps(local) == [1, 2]  # the damaged step is gone: a save at 3 is not refused
        mgr.save(3, _state(3))
    assert all(torch.equal(target[k], v) for k, v in _state(2).items())


def test_delete_waits_for_the_upload_of_the_step(tmp_path: Path) -> None:
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, persist_every=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        assert mgr.delete(2)  # its upload may still run: it is waited for, then both tiers lose it
        mgr.wait_persisted()
        assert 2 not in mgr.steps()
    assert _steps(persistent) == [1, 3] and _steps(local) == [1, 3]


def test_ls_local_refuses_a_missing_directory_and_does_not_judge_encrypted_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import subprocess
    import sys

    pytest.importorskip("cryptography")
    monkeypatch.setenv("SK_TIER_KEK", base64.b64encode(bytes(range(32))).decode())
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local=local, encryption="env:SK_TIER_KEK", persist_every=1) as mgr:
        mgr.save(1, _state(1))
    cmd = [sys.executable, "-m", "shardkeeper.core.cli", "ls", str(persistent)]
    out = subprocess.run([*cmd, f"--local={local}", "--json"], capture_output=True, text=True, check=True)
    (row,) = json.loads(out.stdout)["steps"]
    assert row["tiers"] == ["persistent", "local:0"] and row["local_whole"] is None
    res = subprocess.run([*cmd, f"--local={tmp_path / 'nope'}"], capture_output=True, text=True)
    assert res.returncode == 2 and "no such directory" in res.stderr


def test_incremental_saves_go_through_both_tiers(tmp_path: Path) -> None:
    """Unchanged chunks point at earlier steps' files: the local tier keeps them while a
    retained step points at them, and an upload carries the ones the persistent root lacks."""
    persistent, local = tmp_path / "p", tmp_path / "l"
    frozen = torch.arange(1 << 16, dtype=torch.float32)

    def state(step: int) -> dict[str, torch.Tensor]:  # "late" changes last at step 2, never uploaded alone
        return {**_state(step), "frozen": frozen.clone(), "late": torch.full((1 << 15,), float(min(step, 2)))}

    with CheckpointManager(persistent, local=local, persist_every=2, local_keep=1, incremental=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    assert mgr.persisted_steps == [1, 3]  # (close() waited for the upload)
    files = {p.relative_to(local).as_posix() for p in local.rglob("*.safetensors")}
    assert any(f.startswith("step-000000000001/") for f in files)  # step 3 points into step 1
    uploaded = {p.relative_to(persistent).as_posix() for p in persistent.rglob("*.safetensors")}
    assert any(f.startswith("step-000000000002/") for f in uploaded)  # and into step 2: uploaded with 3
    assert not (persistent / "step-000000000002" / "manifest.json").exists()
    shutil.rmtree(local)  # only the persistent root is left
    target = {k: torch.zeros_like(v) for k, v in state(3).items()}
    with CheckpointManager(persistent, local=local, incremental=True) as mgr:
        assert mgr.restore(target) == 3 and mgr.last_restore_tier == "persistent"
    assert all(torch.equal(target[k], v) for k, v in state(3).items())
