"""The kill -9 campaign (shardkeeper.core.testing.campaign) on local disk and on moto S3, and
gc of incomplete multipart uploads."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.lifecycle.retention import collect_garbage, list_incomplete_uploads
from shardkeeper.core.storage import open_storage
from shardkeeper.core.testing.campaign import KILL_POINTS, run_campaign
from shardkeeper.core.testing.faults import FaultyStorage
from tests.conftest import s3_storage_options

PART = 5 << 20  # the smallest S3 part: a 6 MiB shard file is a two-part multipart upload


def _assert_clean(summary: Any, min_trials: int) -> None:
    js = summary.to_json()
    assert js["failures"] == [] and js["lost_or_damaged"] == 0, json.dumps(js, indent=1)
    assert js["trials"] == min_trials
    assert js["killed"] >= min_trials // 2, js
    assert js["restores_bit_exact"] >= js["trials"] // 2, js
    assert js["commits_acknowledged"] > 0, js


@pytest.mark.timeout(120)
def test_campaign_on_local_disk(tmp_path: Path) -> None:
    summary = run_campaign(str(tmp_path / "root"), trials=24, seed=11, tensor_bytes=256 << 10)
    _assert_clean(summary, 24)
    assert set(summary.points_hit) >= set(KILL_POINTS) - {"random_time"}, summary.points_hit
    assert summary.leftovers_removed > 0


@pytest.mark.timeout(120)
def test_campaign_on_a_local_tier_with_uploads_behind_it(tmp_path: Path) -> None:
    """The kills land in the local tier (docs/tiers.md) while every other step is uploaded
    to the persistent root: nothing acknowledged is lost locally, the newest local step
    restores bit for bit, and what the persistent root lists verifies."""
    local = tmp_path / "local"
    summary = run_campaign(str(tmp_path / "persistent"), trials=24, seed=5, tensor_bytes=256 << 10, local=str(local))
    _assert_clean(summary, 24)
    assert set(summary.points_hit) >= set(KILL_POINTS) - {"random_time"}, summary.points_hit
    assert (local / ".shardkeeper-node").exists() and any((tmp_path / "persistent").glob("step-*/manifest.json"))


@pytest.mark.s3
@pytest.mark.timeout(180)
def test_campaign_on_s3_kills_mid_multipart(s3_server: str, s3_fs: Any) -> None:
    bucket = f"sk-camp-{uuid.uuid4().hex[:12]}"
    s3_fs.mkdir(bucket)
    try:
        summary = run_campaign(
            f"s3://{bucket}/run",
            trials=10,
            seed=5,
            tensor_bytes=6 << 20,
            points=("mid_write", "before_manifest", "retention", "after_manifest", "close"),
            storage_options={**s3_storage_options(s3_server), "part_size_bytes": PART},
            manager_options={"max_files_per_rank": 1},
        )
        _assert_clean(summary, 10)
        assert summary.points_hit["mid_write"] >= 1
        assert summary.incomplete_uploads_aborted >= 1, summary.to_json()
        assert s3_fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") in (None, [])
    finally:
        s3_fs.rm(bucket, recursive=True)


@pytest.mark.s3
@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", ["s3", "seaweed"])
def test_gc_aborts_only_old_incomplete_multipart_uploads(server: str, request: pytest.FixtureRequest) -> None:
    url, options = request.getfixturevalue(f"{server}_root")
    storage = open_storage(url, **options, part_size_bytes=PART)
    w = storage.open_writer("step-000000000003/data/r00000-dead-000.safetensors")
    w.write(b"x" * (PART + 1))  # one part uploaded: an upload in flight, as a killed save leaves it
    w._f.closed = True  # type: ignore[attr-defined]  # and never completed nor aborted (no __del__ close)
    assert not storage.exists("step-000000000003/data/r00000-dead-000.safetensors")
    (upload,) = list_incomplete_uploads(storage)
    young = collect_garbage(storage, min_age_s=600, now=upload["initiated"] + 10)
    assert young.aborted_uploads == [] and any("multipart" in s for s in young.skipped_young)
    old = collect_garbage(storage, min_age_s=600, now=upload["initiated"] + 601)
    assert old.aborted_uploads == [upload["path"]]
    assert "aborted_uploads" in old.to_json()
    assert list_incomplete_uploads(storage) == []


@pytest.mark.timeout(60)
def test_campaign_command_prints_a_json_summary(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper.core.testing.campaign",
            str(tmp_path / "r"),
            "--trials",
            "3",
            "--seed",
            "2",
            "--tensor-bytes",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    assert js["trials"] == 3 and js["lost_or_damaged"] == 0


@pytest.mark.timeout(60)
def test_manager_options_may_set_the_campaigns_own_defaults(tmp_path: Path) -> None:
    """``keep_last`` (and ``async_save``) are the campaign's defaults, not fixed: passing one
    used to raise TypeError (a keyword given twice) in every writer, reported as data loss."""
    out = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.testing.campaign", str(tmp_path / "r"), "--trials", "3",
         "--seed", "2", "--tensor-bytes", "4096", "--manager-options", '{"keep_last": 3, "async_save": false}'],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    js = json.loads(out.stdout)
    assert js["lost_or_damaged"] == 0 and js["writer_errors"] == [] and js["trials"] == 3, js


def test_a_manager_option_the_campaign_cannot_pass_is_refused_before_any_writer(tmp_path: Path) -> None:
    for bad, said in (
        ({"keep_lats": 2}, "not a CheckpointManager keyword"),
        ({"local": "/x"}, "campaign's own"),
        ({"encryption": "env:SK_NONE"}, "without a key"),  # its checks read the root without one
        ({"keep_last": 0}, "CheckpointManager refuses"),
        ({"local_keep": 1}, "CheckpointManager refuses"),  # a tier's option, and no --local
        ([1], "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=said) as e:
            run_campaign(str(tmp_path / "r"), trials=2, manager_options=bad)  # type: ignore[arg-type]
        if isinstance(bad, dict):
            assert repr(next(iter(bad))) in str(e.value)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    out = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.testing.campaign", str(tmp_path / "r"), "--manager-options", '{"keep_last": 0}'],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "CheckpointManager refuses" in out.stderr and not out.stdout, out
    for argv, said in (
        (["--storage-options", "[1]"], "must be a JSON object"),
        (["--storage-options", '{"bogus": 1}'], "bogus"),
        (["--local", str(tmp_path / "r" / "tier")], f"{tmp_path / 'r' / 'tier'}' is inside the root"),
    ):
        cmd = [sys.executable, "-m", "shardkeeper.core.testing.campaign", str(tmp_path / "r"), "--trials", "1", *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=50, check=False)
        assert out.returncode == 2 and said in out.stderr and not out.stdout, (argv, out)


@pytest.mark.timeout(60)
def test_a_writer_that_fails_is_reported_with_its_error_not_as_data_loss(tmp_path: Path) -> None:
    """A writer's own failure (here: the root is a file, which no check before the trials
    sees) is listed with its error under writer_errors, not as data lost or damaged."""
    (tmp_path / "r").write_bytes(b"not a directory")
    summary = run_campaign(str(tmp_path / "r"), trials=2, seed=1, tensor_bytes=4096, points=("retention",))
    js = summary.to_json()
    assert js["lost_or_damaged"] == 0 and len(js["writer_errors"]) == 2, js
    assert all(
        "exit status 3" in w and "CheckpointSaveError" in w and "Not a directory" in w for w in js["writer_errors"]
    ), js


@pytest.mark.timeout(120)
def test_a_storage_that_loses_acknowledged_writes_is_reported_not_raised(tmp_path: Path) -> None:
    """A storage that drops what it acknowledged (zeros where the data was, every write and
    close succeeding: a lying fsync, then a power cut) damages every committed step. The
    campaign, given that storage object, names the damage in its summary: it used to raise
    CheckpointRestoreError out of its own restore check."""
    inner = open_storage(str(tmp_path / "root"))
    lying = FaultyStorage(inner, lose="*/data/*")
    summary = run_campaign(lying, trials=2, seed=3, tensor_bytes=16 << 10, points=("after_manifest",))
    js = summary.to_json()
    assert js["root"] == inner.url and js["trials"] == 2 and js["commits_acknowledged"] > 0, js
    assert js["restores_bit_exact"] == 0 and js["writer_errors"] == [], js
    said = "\n".join(js["failures"])
    assert "does not verify" in said and "did not restore" in said and "CheckpointRestoreError" in said, said
    assert all(f.startswith("trial ") and "after_manifest" in f for f in js["failures"]), said
    with pytest.raises(ValueError, match="storage_options"):
        run_campaign(lying, trials=1, storage_options={"fsync": False})
