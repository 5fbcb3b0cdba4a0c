"""The real Trainer (one process, CPU) through shardkeeper: resume targets and the refusals
before training, retention and the best model, ``save_only_model``, the Trainer's own folders,
export for ``from_pretrained``, and ``disable``."""

from __future__ import annotations

import logging
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("shardkeeper.transformers")

import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from shardkeeper.core import CheckpointManager, CheckpointNotFoundError, ChecksumMismatchError  # noqa: E402
from shardkeeper.transformers import ShardkeeperTrainer, disable, export_pretrained, plugin_of  # noqa: E402
from tests.checks import state_diff, state_of  # noqa: E402
from tests.transformers.common import CONSTANT, SAVE_EVERY, STEPS, Recording, Tokens, make_trainer, tiny_model  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


def _steps(root: Path) -> list[int]:
    with CheckpointManager(root) as mgr:
        return mgr.steps()


def _after(losses: list[tuple[int, str]], step: int) -> list[tuple[int, str]]:
    return [x for x in losses if x[0] >= step]


def test_saves_commit_every_save_step_with_the_trainers_metadata(reference: tuple[Path, Any]) -> None:
    root, trainer = reference
    assert _steps(root) == [4, 8, 12]
    with CheckpointManager(root) as mgr:
        m = mgr.manifest(12)
        assert m.metadata["framework"] == "transformers"
        assert m.metadata["transformers_version"] == transformers.__version__
        keys = list(m.leaves)
        assert any(k.startswith("model/transformer.h.0.") for k in keys)
        assert any(k.startswith("optim/") for k in keys) and any(k.startswith("sched/") for k in keys)
        assert any(k.startswith("rng/0/") for k in keys)
        saved = mgr.load(12, only="progress/*")["progress"]
    assert saved["step"] == 12 and saved["epoch"] == 2
    state = saved["transformers"]["trainer_state"]
    assert state["global_step"] == 12 and state["log_history"] == trainer.state.log_history[: len(state["log_history"])]
    assert "is_world_process_zero" not in state  # per process: never saved


def test_resume_by_step_number_continues_bit_exact(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    _, ref = reference
    root = tmp_path / "run"
    make_trainer(root, max_steps=8, **CONSTANT).train()
    assert _steps(root) == [4, 8]
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=8)
    assert resumed.losses == _after(ref.losses, 8)
    assert not state_diff(
        state_of(resumed.model, resumed.optimizer.optimizer), state_of(ref.model, ref.optimizer.optimizer)
    )
    assert _steps(root) == [4, 8, 12] and resumed.state.global_step == STEPS


def test_resume_from_a_step_folder_of_another_root(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    ref_root, ref = reference
    with CheckpointManager(ref_root) as mgr:
        folder = mgr.step_url(4)
    new_root = tmp_path / "new"
    resumed = make_trainer(new_root, **CONSTANT)
    resumed.train(resume_from_checkpoint=folder)
    assert resumed.losses == _after(ref.losses, 4)
    assert _steps(new_root) == [8, 12]  # saves go to this run's root
    assert _steps(ref_root) == [4, 8, 12]


def test_resume_targets_that_cannot_resume_fail_before_training(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    ref_root, _ = reference
    empty = make_trainer(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"no committed checkpoint under .*empty \(rank 0\)"):
        empty.train(resume_from_checkpoint=True)
    # a fresh run, or a resume from an older step, into a root with later steps could save none
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    fresh = make_trainer(copy)
    with pytest.raises(
        ValueError,
        match=r"already holds committed step 12 \(rank 0\); this run starts from step 0.*resume_from_checkpoint=True",
    ):
        fresh.train()
    older = make_trainer(copy)
    with pytest.raises(ValueError, match=r"this run resumes from step 4, so it could save no checkpoint up to step 12"):
        older.train(resume_from_checkpoint=4)
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 is not committed under .*committed steps: 4, 8, 12"):
        older.train(resume_from_checkpoint=5)
    for bad, error, text in (
        ("", ValueError, "names no root or folder"),
        (-1, ValueError, r"resume_from_checkpoint=-1: a step number is >= 0 \(rank 0\)"),
        (4.0, TypeError, "True, a step number, a root or a step folder, not 4.0"),
        (str(copy / "LATEST"), ValueError, "is a file, not a root or a step folder"),
        (str(tmp_path / "nope" / "step-000000000004"), CheckpointNotFoundError, r"no such folder \(rank 0\)"),
    ):
        with pytest.raises(error, match=text):
            older.train(resume_from_checkpoint=bad)
    assert fresh.losses == older.losses == [] and _steps(copy) == [4, 8, 12]
    numpy = pytest.importorskip("numpy")
    resumed = make_trainer(copy, **CONSTANT)
    resumed.train(resume_from_checkpoint=numpy.int64(12))  # any integral step number
    assert resumed.state.global_step == STEPS and resumed.losses == []
    for text in ("12", "true", "True"):  # as a command line passes them (HfArgumentParser: a string)
        again = make_trainer(copy, **CONSTANT)
        again.train(resume_from_checkpoint=text)
        assert again.state.global_step == STEPS and again.losses == []


def test_a_fresh_run_on_a_used_root_is_refused_before_any_step(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """The Trainer's refusal is the core's shared one (every adapter's): a ``StartRefusedError``
    (a ``ValueError`` still) before the first step, naming the root, the newest step and every
    remedy, the model untouched."""
    from shardkeeper.core import StartRefusedError

    ref_root, _ = reference
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    fresh = make_trainer(copy)
    before = state_of(fresh.model)
    with pytest.raises(StartRefusedError) as refused:
        fresh.train()
    msg = str(refused.value)
    assert f"{copy} already holds committed step 12 (rank 0); this run starts from step 0" in msg
    assert "resume_from_checkpoint=True" in msg and "another output_dir, or enable(trainer, root=...)" in msg
    assert "start over with this root emptied" in msg
    assert fresh.state.global_step == 0 and fresh.losses == []
    assert not state_diff(state_of(fresh.model), before)


def _run_the_remedy(message: str) -> None:
    """Run the ``shardkeeper delete ... --damaged`` command the error names, as a user would."""
    import re
    import shlex

    from shardkeeper.core.cli import main

    found = re.search(r"`shardkeeper (delete [^`]+ --damaged)`", message)
    assert found, message
    assert main(shlex.split(found.group(1))) == 0


def test_a_damaged_data_file_names_the_remedy_that_resumes(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """A flipped byte in step 12's data: the digest check refuses it with what a Trainer user
    does (the Trainer resumes only from the newest step): delete the damaged step with the
    command it names, then resume from the newest intact one, which continues bit for bit."""
    ref_root, ref = reference
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    with CheckpointManager(copy) as mgr:
        (data,) = sorted((Path(mgr.step_url(12)) / "data").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"step 12 under .* is damaged \(rank 0\).*shardkeeper delete") as e:
        make_trainer(copy, **CONSTANT).train(resume_from_checkpoint=True)
    assert e.value.file and e.value.key  # the core error's attributes survive
    _run_the_remedy(str(e.value))
    trainer = make_trainer(copy, **CONSTANT)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.losses == _after(ref.losses, 8) and _steps(copy) == [4, 8, 12]


def test_a_damaged_newest_manifest_is_refused_before_training(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """Step 12's manifest unreadable: the newest committed step is 8, but a save at 12 would
    still be refused (the step is listed by its manifest's name). Said before training, with
    the remedy that works (the delete command it names), which then resumes."""
    ref_root, ref = reference
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    with CheckpointManager(copy) as mgr:
        (Path(mgr.step_url(12)) / "manifest.json").write_text("{not json")
    trainer = make_trainer(copy, **CONSTANT)
    with pytest.raises(
        ValueError, match=r"step 12 under .* is damaged: its manifest cannot be read \(rank 0\).*Delete the damaged"
    ) as e:
        trainer.train(resume_from_checkpoint=True)
    assert trainer.losses == []
    _run_the_remedy(str(e.value))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.losses == _after(ref.losses, 8) and _steps(copy) == [4, 8, 12]


def test_a_plain_core_checkpoint_resumes_at_its_step(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """A plain save (no progress entry, no optimizer): the Trainer resumes at the
    checkpoint's step with its model, and saves from there."""
    ref_root, ref = reference
    model = tiny_model()
    with CheckpointManager(ref_root) as src:
        src.restore({"model": model}, step=8, only="model/*")
    root = tmp_path / "plain"
    with CheckpointManager(root) as mgr:
        mgr.save(8, {"model": model}).wait()
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.losses[0][0] == 8 and resumed.state.global_step == STEPS
    assert _steps(root) == [8, 12]


def test_a_retry_after_a_failed_train_waits_for_the_save_in_flight(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """async_save: train() fails at step 6 while the commit of step 4 is still held back; a
    retry with resume_from_checkpoint=True on the same Trainer must see step 4 committed
    (before, it saw no committed step, or resumed from a stale one and failed at its save)."""
    _, ref = reference
    root = tmp_path / "run"
    trainer = make_trainer(root, options={"async_save": True}, **CONSTANT)
    storage = plugin_of(trainer).manager().storage
    put, release = storage.put_if_absent, threading.Event()

    def held(path: str, data: bytes) -> None:
        if path.endswith("manifest.json"):
            release.wait(30)
        put(path, data)

    storage.put_if_absent = held  # type: ignore[method-assign]

    class Fail(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 6:
                threading.Timer(1.0, release.set).start()  # the commit lands while the error unwinds
                raise RuntimeError("boom at step 6")

    trainer.add_callback(Fail)
    with pytest.raises(RuntimeError, match="boom at step 6"):
        trainer.train()
    trainer.remove_callback(Fail)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=True)
    assert trainer.losses == _after(ref.losses, 4) and _steps(root) == [4, 8, 12]


def test_a_subclass_wrapping_train_is_enabled(tmp_path: Path) -> None:
    """A Trainer subclass whose train() takes (*args, **kwargs) passes the contract (the
    installed Trainer is what is checked), and its train() runs inside the adapter's."""
    calls: list[Any] = []

    class Wrapping(Recording):
        def train(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("resume_from_checkpoint"))
            return super().train(*args, **kwargs)

    trainer = make_trainer(tmp_path / "run", max_steps=4, cls=Wrapping)
    trainer.train()
    assert calls == [None] and _steps(tmp_path / "run") == [4]


def test_a_torn_step_folder_is_refused_by_name(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    ref_root, _ = reference
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    with CheckpointManager(copy) as mgr:
        folder = Path(mgr.step_url(12))
    (folder / "manifest.json").unlink()  # as a crash before the commit leaves it
    trainer = make_trainer(tmp_path / "other")
    with pytest.raises(CheckpointNotFoundError, match=r"is not a committed step \(rank 0\): it may be torn"):
        trainer.train(resume_from_checkpoint=str(folder))
    resumed = make_trainer(copy, **CONSTANT)
    resumed.train(resume_from_checkpoint=True)  # the newest committed one: 8
    assert resumed.losses[0][0] == 8


def test_save_total_limit_is_retention_after_each_commit(tmp_path: Path) -> None:
    root = tmp_path / "run"
    make_trainer(root, save_total_limit=2).train()
    assert _steps(root) == [8, 12]


def test_best_checkpoint_is_kept_and_loaded_at_the_end(tmp_path: Path) -> None:
    root = tmp_path / "run"
    trainer = make_trainer(
        root,
        evaluate=True,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=SAVE_EVERY,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the highest eval loss: an early step, which retention must keep
    )
    trainer.train()
    best = trainer.state.best_global_step
    assert best in (4, 8), best
    assert _steps(root) == [best, 12]
    assert trainer.state.best_model_checkpoint == str(root / f"checkpoint-{best}")  # its folder, as the Trainer's
    with CheckpointManager(root) as mgr:
        saved = mgr.load(best, only="model/*")["model"]
    got = {k: v.detach() for k, v in trainer.model.state_dict().items() if k in saved}
    assert not state_diff(got, {k: saved[k] for k in got})


def test_save_only_model_saves_no_optimizer_and_still_resumes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    make_trainer(root, max_steps=8, save_only_model=True).train()
    with CheckpointManager(root) as mgr:
        keys = list(mgr.manifest(8).leaves)
    assert keys and not [
        k
        for k in keys
        if k.split("/")[0] in ("optim", "sched", "rng", "extra") and not k.startswith("extra/data_position/")
    ]
    assert "extra/data_position/0/consumed" in keys  # the data position, as the step count, is kept
    resumed = make_trainer(root, save_only_model=True)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.losses[0][0] == 8 and resumed.state.global_step == STEPS
    assert _steps(root) == [4, 8, 12]


def test_a_folder_the_trainer_wrote_resumes_through_its_own_loaders(
    tmp_path: Path, reference: tuple[Path, Any]
) -> None:
    _, ref = reference
    stock_dir = tmp_path / "stock"
    args = TrainingArguments(
        output_dir=str(stock_dir),
        per_device_train_batch_size=4,
        max_steps=4,
        save_strategy="steps",
        save_steps=4,
        learning_rate=1e-3,
        seed=7,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        lr_scheduler_type="constant",
    )
    Trainer(model=tiny_model(), args=args, train_dataset=Tokens()).train()
    assert (stock_dir / "checkpoint-4" / "trainer_state.json").is_file()
    root = tmp_path / "run"
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=str(stock_dir / "checkpoint-4"))
    assert resumed.losses == _after(ref.losses, 4)
    assert _steps(root) == [8, 12]


def test_push_to_hub_is_refused_before_the_trainer_is_built(tmp_path: Path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path / "run"), push_to_hub=True, report_to="none", use_cpu=True)
    with pytest.raises(NotImplementedError, match="push_to_hub pushes the Trainer's own checkpoint folders"):
        ShardkeeperTrainer(model=tiny_model(), args=args, train_dataset=Tokens())


def test_a_subclass_override_enable_replaces_is_warned_about(tmp_path: Path) -> None:
    """A subclass's ``_save_checkpoint`` (DLRover's and axolotl's override it) no longer runs
    once ``enable()`` replaces it on the instance: said, naming the class and the method."""

    class ExtraFiles(Recording):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:  # pragma: no cover - shadowed
            super()._save_checkpoint(model, trial)

    with pytest.warns(UserWarning, match=r"ExtraFiles\._save_checkpoint override\(s\) Trainer method\(s\)"):
        make_trainer(tmp_path / "run", cls=ExtraFiles)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "plain")  # no override: no such warning
    assert not [w for w in seen if "override" in str(w.message)], [str(w.message) for w in seen]


def test_a_newer_trainer_folder_beside_committed_steps_is_named(
    tmp_path: Path, reference: tuple[Path, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``resume_from_checkpoint=True`` resumes the newest committed step; a newer
    ``checkpoint-N`` the Trainer wrote itself there (before shardkeeper was enabled) is never
    picked silently: the warning names it and how to resume from it."""
    ref_root, _ = reference
    copy = tmp_path / "copy"
    shutil.copytree(ref_root, copy)
    (copy / "checkpoint-20").mkdir()
    (copy / "checkpoint-20" / "trainer_state.json").write_text('{"global_step": 20}')
    trainer = make_trainer(copy, **CONSTANT)
    with caplog.at_level(logging.WARNING, logger="shardkeeper.transformers"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == STEPS
    text = caplog.text
    assert "resuming from committed step 12" in text and "checkpoint-20 there is newer" in text, text
    assert f"resume_from_checkpoint={str(copy / 'checkpoint-20')!r}" in text, text


def test_fsdp_on_xla_is_refused_at_enable(tmp_path: Path) -> None:
    """FSDP on XLA (``fsdp_config={"xla": True}``, torch_xla's own wrapper) has no path here: it
    is refused at ``enable()`` with the supported layouts named, and the Trainer keeps its own
    methods. (torch_xla is not installed: the Trainer's flag is set as its ``__init__`` would.)"""
    from transformers import Trainer

    from shardkeeper.transformers import enable

    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=Tokens())
    trainer.is_fsdp_xla_enabled = True
    with pytest.raises(NotImplementedError, match=r"FSDP on XLA .* is not supported .*Accelerate's FSDP plugin"):
        enable(trainer)
    assert "_save_checkpoint" not in vars(trainer) and not hasattr(trainer, "_shardkeeper")


def test_export_needs_the_config_first(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    root, _ = reference
    with pytest.raises(TypeError, match="config must be the model's PretrainedConfig"):
        export_pretrained(root, tmp_path / "hf", config=None)
    assert not (tmp_path / "hf").exists()


def test_export_loads_with_from_pretrained(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    root, trainer = reference
    out = tmp_path / "hf"
    res = export_pretrained(root, out, config=trainer.model.config, step=12, max_shard_size="40KB", progress=False)
    assert len(res.files) > 1 and (out / "config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trainer.model(ids).logits)


def test_disable_gives_the_trainer_its_methods_back(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path / "run", max_steps=4)
    plugin = plugin_of(trainer)
    assert "_save_checkpoint" in vars(trainer) and "train" in vars(trainer)
    disable(trainer)
    assert "_save_checkpoint" not in vars(trainer) and "train" not in vars(trainer)
    assert "_shardkeeper" not in vars(trainer)
    with pytest.raises(RuntimeError, match="not enabled on this Trainer"):
        plugin_of(trainer)
    trainer.train()  # the Trainer's own checkpoints again
    assert (tmp_path / "run" / "checkpoint-4").is_dir() and plugin.last_handle is None
