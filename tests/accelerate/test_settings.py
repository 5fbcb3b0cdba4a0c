"""Settings precedence (argument > SHARDKEEPER_* > shardkeeper.yaml > default) and single-process errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration
from torch import nn

import shardkeeper.accelerate as ska
from shardkeeper.accelerate.config import config_file_path, resolve_settings
from shardkeeper.core.errors import CommitConflictError, StepOrderError
from tests.accelerate._native import native_folder
from tests.checks import assert_same_state


class _Provider:
    """A KeyProvider by its protocol (never asked to wrap here)."""

    key_id = "test"

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        raise AssertionError("not used")

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        raise AssertionError("not used")


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for k in ("SHARDKEEPER_CONFIG_FILE", "SHARDKEEPER_ROOT", "SHARDKEEPER_ASYNC_SAVE", "SHARDKEEPER_KEEP_LAST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = tmp_path / "hf" / "accelerate" / "shardkeeper.yaml"
    path.parent.mkdir(parents=True)
    return path


def test_config_file_lives_beside_accelerate_config(cfg: Path) -> None:
    assert config_file_path() == cfg


def test_precedence_argument_env_file_default(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_settings({})["resume_dataloaders"] is True  # default
    assert "async_save" not in resolve_settings({})  # the core's own default applies
    cfg.write_text("root: /from/file\nasync_save: false\nkeep_last: 3\nio_threads: 2\n")
    s = resolve_settings({})
    assert (s["root"], s["async_save"], s["keep_last"], s["io_threads"]) == ("/from/file", False, 3, 2)
    monkeypatch.setenv("SHARDKEEPER_ROOT", "/from/env")
    monkeypatch.setenv("SHARDKEEPER_ASYNC_SAVE", "1")
    s = resolve_settings({})
    assert (s["root"], s["async_save"], s["keep_last"]) == ("/from/env", True, 3)
    s = resolve_settings({"root": "/from/arg", "keep_last": None})
    assert (s["root"], s["keep_last"]) == ("/from/arg", 3)  # None = not given


def test_every_core_option_can_be_set_from_the_environment_and_the_file(
    cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options added to the core (compression, catalog, encryption, staging, retries, ...) are
    settings too, converted from text; an object (a KeyProvider) passed as an argument is kept."""
    for k in ("SHARDKEEPER_COMPRESSION", "SHARDKEEPER_STAGING", "SHARDKEEPER_ENCRYPTION"):
        monkeypatch.delenv(k, raising=False)
    cfg.write_text("incremental: true\nretry_max_attempts: 7\ncompression_level: 1\n")
    monkeypatch.setenv("SHARDKEEPER_COMPRESSION", "zstd")
    monkeypatch.setenv("SHARDKEEPER_STAGING", "overlap")
    monkeypatch.setenv("SHARDKEEPER_ENCRYPTION", "env:MY_KEK")
    s = resolve_settings({})
    assert (s["incremental"], s["retry_max_attempts"], s["compression_level"]) == (True, 7, 1)
    assert (s["compression"], s["staging"], s["encryption"]) == ("zstd", "overlap", "env:MY_KEK")
    provider = _Provider()
    assert resolve_settings({"encryption": provider})["encryption"] is provider


def test_bad_settings_name_their_source(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg.write_text("keep_lats: 3\n")
    with pytest.raises(ValueError, match=r"shardkeeper.yaml: unknown setting\(s\) keep_lats"):
        resolve_settings({})
    cfg.write_text("")
    monkeypatch.setenv("SHARDKEEPER_KEEP_LAST", "three")
    with pytest.raises(ValueError, match=r"\$SHARDKEEPER_KEEP_LAST is 'three', not a valid int"):
        resolve_settings({})
    with pytest.raises(TypeError, match=r"accelerate option\(s\): asnyc_save \(did you mean async_save\?\)"):
        resolve_settings({"asnyc_save": True})
    monkeypatch.delenv("SHARDKEEPER_KEEP_LAST")
    with pytest.raises(ValueError, match=r"'staging' from the arguments of enable\(\) is 'later', not one of blocking"):
        resolve_settings({"staging": "later"})


def test_single_process_roundtrip_and_errors(cfg: Path, tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "proj")))
    ska.enable(acc, async_save=False)
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    model, opt = acc.prepare(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoint under .*proj/checkpoints \(rank 0\)"):
        acc.load_state()
    path = acc.save_state()
    assert path.endswith("step-000000000000") and acc.project_configuration.iteration == 1
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    acc.project_configuration.iteration = 0
    with pytest.raises(CommitConflictError, match=r"step 0 is already committed under .*proj/checkpoints \(rank 0\)"):
        acc.save_state()
    assert acc.load_state() == 0
    assert_same_state(model.state_dict(), want, what="the restored model")
    assert acc.project_configuration.iteration == 1  # the counter continues after the restored save
    # a save below the newest committed step would make a resume go back to that newer step
    acc.save_state(step=5)
    assert acc.project_configuration.iteration == 6
    acc.project_configuration.iteration = 2
    with pytest.raises(
        StepOrderError,
        match=r"step 2 is below the newest committed step 5 under .*proj/checkpoints "
        r"\(rank 0\).*Call accelerator.load_state\(\) first",
    ):
        acc.save_state()
    assert acc.load_state() == 5 and acc.project_configuration.iteration == 6
    assert acc.save_state().endswith("step-000000000006")
    acc.end_training()


def test_import_accelerate_save_state_folder(cfg: Path, tmp_path: Path) -> None:
    """A folder from Accelerate's own save_state imports only with trust_pickle=True."""
    acc, model, opt, folder = native_folder(tmp_path, "checkpoint_7")
    want_w = model.weight.detach().clone()
    want_m = opt.optimizer.state[model.weight]["exp_avg"].clone()
    ska.enable(acc, root=str(tmp_path / "sk"), async_save=False)
    with pytest.raises(PermissionError, match=r"may unpickle \(.*optimizer.bin.*trust_pickle=True"):
        ska.import_accelerate_checkpoint(acc, str(folder))
    with torch.no_grad():
        model.weight.zero_()
    with pytest.warns(UserWarning, match="unpickling"):
        path = ska.import_accelerate_checkpoint(acc, str(folder), trust_pickle=True)
    assert path.endswith("step-000000000007")
    with torch.no_grad():
        model.weight.zero_()
        opt.optimizer.state[model.weight]["exp_avg"].zero_()
    assert acc.load_state() == 7
    assert torch.equal(model.weight, want_w)
    assert torch.equal(opt.optimizer.state[model.weight]["exp_avg"], want_m)
    acc.end_training()


def test_counters_in_the_layout_before_progress_accelerate(cfg: Path, tmp_path: Path) -> None:
    """Checkpoints written before the counters moved to progress/accelerate/ still load them."""
    from accelerate.state import AcceleratorState

    from shardkeeper.core import CheckpointManager

    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    lin = nn.Linear(3, 2)
    acc.prepare(lin)
    root = tmp_path / "old"
    with CheckpointManager(str(root)) as mgr:  # the old layout, written by the core directly
        mgr.save(4, {"model": lin, "progress": {"iteration": 5, "step": 17}}, async_save=False)
    ska.enable(acc, root=str(root), async_save=False)
    assert acc.load_state() == 4
    assert (acc.project_configuration.iteration, acc.step) == (5, 17)
    acc.save_state()
    with CheckpointManager(str(root)) as mgr:
        m = mgr.manifest(5)
    assert {"progress/accelerate/iteration", "progress/accelerate/step"} <= set(m.leaves)
    assert "progress/iteration" not in m.leaves
    acc.end_training()


def test_metadata_setting_reaches_the_manifest_and_cannot_spoof_the_adapter(cfg: Path, tmp_path: Path) -> None:
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"metadata key\(s\) framework are written by the accelerate adapter"):
        ska.enable(acc, root=str(tmp_path / "r"), metadata={"framework": "lightning"})
    ska.enable(acc, root=str(tmp_path / "r"), async_save=False, metadata={"run": "a"})
    acc.save_state()
    from shardkeeper.core import CheckpointManager

    with CheckpointManager(str(tmp_path / "r")) as mgr:
        meta = mgr.manifest(0).metadata
    assert meta["run"] == "a" and meta["framework"] == "accelerate" and meta["progress_schema"] == 1
    acc.end_training()
