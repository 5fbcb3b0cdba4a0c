"""The Trainer's ``checkpoint-N`` folders through shardkeeper (one process, CPU): each committed
step is a folder in ``output_dir`` holding no tensor data, ``get_last_checkpoint`` names the
newest committed one (never a step whose commit did not happen), a resume from that folder is
bit-exact, and retention (``save_total_limit``, the best checkpoint) and the folders agree."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("shardkeeper.transformers")

from transformers import Trainer, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from shardkeeper.core import CheckpointManager, CheckpointNotFoundError, ChecksumMismatchError  # noqa: E402
from shardkeeper.core.commit.committed import committed_steps, manifest_path  # noqa: E402
from shardkeeper.transformers import enable, plugin_of  # noqa: E402
from tests.checks import assert_checks, read_checks, state_diff, state_of  # noqa: E402
from tests.launch import run_script  # noqa: E402
from tests.transformers.common import CONSTANT, SAVE_EVERY, STEPS, Tokens, make_trainer, tiny_model  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "dist" / "folder_worker.py"


def _steps(root: Path) -> list[int]:
    with CheckpointManager(root) as mgr:
        return mgr.steps()


def _folders(out: Path) -> list[str]:
    found = [p.name for p in out.iterdir() if p.name.startswith("checkpoint-") and p.is_dir()]
    return sorted(found, key=lambda n: int(n.removeprefix("checkpoint-")))


def _after(losses: list[tuple[int, str]], step: int) -> list[tuple[int, str]]:
    return [x for x in losses if x[0] >= step]


def _same_as_reference(trainer: Any, ref: Any, step: int) -> None:
    """The resumed run's losses from ``step`` on and its final parameters and AdamW state
    equal the uninterrupted run's, bit for bit."""
    assert trainer.losses == _after(ref.losses, step)
    diff = state_diff(
        state_of(trainer.model, trainer.optimizer.optimizer), state_of(ref.model, ref.optimizer.optimizer)
    )
    assert not diff, diff


def test_each_committed_step_is_a_checkpoint_folder_without_tensor_data(reference: tuple[Path, Any]) -> None:
    root, trainer = reference
    assert _folders(root) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-12")
    for step in (4, 8, 12):
        folder = root / f"checkpoint-{step}"
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["shardkeeper.json", "trainer_state.json"], names
        assert sum(p.stat().st_size for p in folder.iterdir()) < 64 * 1024  # no tensor data
        pointer = json.loads((folder / "shardkeeper.json").read_text())
        assert pointer["format"] == "shardkeeper-transformers-pointer" and pointer["step"] == step
        assert pointer["root"] == str(root) and pointer["root_relative"] == ".."
        state = TrainerState.load_from_json(str(folder / "trainer_state.json"))  # the Trainer's own reader
        assert state.global_step == step
        assert state.log_history == trainer.state.log_history[: len(state.log_history)]


def test_a_resume_from_get_last_checkpoint_is_bit_exact(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """What TRL and axolotl scripts do: ``train(resume_from_checkpoint=get_last_checkpoint(output_dir))``."""
    _, ref = reference
    root = tmp_path / "run"
    make_trainer(root, max_steps=8, **CONSTANT).train()
    last = get_last_checkpoint(str(root))
    assert last == str(root / "checkpoint-8")
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=last)
    _same_as_reference(resumed, ref, 8)
    assert _steps(root) == [4, 8, 12] and _folders(root) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]


def test_a_moved_output_dir_and_a_root_elsewhere_resume_from_their_folders(
    tmp_path: Path, reference: tuple[Path, Any]
) -> None:
    """The folder finds its root beside it after ``output_dir`` moved (``root_relative``), and a
    root that is not ``output_dir`` (``enable(trainer, root=...)``) gets its folders in
    ``output_dir`` all the same."""
    _, ref = reference
    root = tmp_path / "run"
    make_trainer(root, max_steps=8, **CONSTANT).train()
    moved = tmp_path / "moved"
    shutil.move(str(root), str(moved))
    resumed = make_trainer(moved, **CONSTANT)
    resumed.train(resume_from_checkpoint=get_last_checkpoint(str(moved)))
    _same_as_reference(resumed, ref, 8)

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    first = make_trainer(out, max_steps=4, **CONSTANT)
    enable(first, root=str(elsewhere))
    first.train()
    assert _steps(elsewhere) == [4] and _folders(out) == ["checkpoint-4"]
    assert json.loads((out / "checkpoint-4" / "shardkeeper.json").read_text())["root"] == str(elsewhere)
    second = make_trainer(out, **CONSTANT)
    enable(second, root=str(elsewhere))
    second.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    _same_as_reference(second, ref, 4)
    assert _folders(out) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]


def test_a_save_that_fails_leaves_no_folder(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """Step 8's commit fails (its manifest cannot be written): no ``checkpoint-8``;
    ``get_last_checkpoint`` names step 4, and a resume from it is bit-exact."""
    _, ref = reference
    root = tmp_path / "run"
    trainer = make_trainer(root, **CONSTANT)
    storage = plugin_of(trainer).manager().storage
    put = storage.put_if_absent

    def failing(path: str, data: bytes) -> None:
        if path == manifest_path(8):
            raise OSError(28, "No space left on device")
        put(path, data)

    storage.put_if_absent = failing  # type: ignore[method-assign]
    with pytest.raises(Exception, match="No space left on device"):
        trainer.train()
    assert _steps(root) == [4] and _folders(root) == ["checkpoint-4"]
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-4")
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=get_last_checkpoint(str(root)))
    _same_as_reference(resumed, ref, 4)


@pytest.mark.multiprocess
def test_a_kill_between_the_commit_and_its_folder_leaves_only_a_missing_folder(tmp_path: Path) -> None:
    """SIGKILL right after step 8's manifest is written (committed), before anything else:
    its folder is missing, never a folder of an uncommitted step; the next ``train()`` writes
    it and resumes step 8 bit for bit (the reference runs in the worker's launch too)."""
    env = {"HF_HUB_OFFLINE": "1"}
    killed = run_script(1, WORKER, "reference+kill", str(tmp_path), timeout_s=240, env=env)
    assert killed.returncode != 0 and (tmp_path / "killed").exists(), killed.stdout[-4000:]
    root = tmp_path / "run"
    assert _steps(root) == [4, 8]
    assert _folders(root) == ["checkpoint-4"]
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-4")
    resumed = run_script(1, WORKER, "resume", str(tmp_path), timeout_s=240, env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    checks = read_checks(tmp_path / "resume-rank0.json", output=resumed.stdout)
    names = ["resumed_at_the_committed_step", "next_losses_bit_exact", "final_params_and_optimizer_bit_exact"]
    assert_checks(checks, names)
    assert _folders(root) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]


def test_retention_removes_a_folder_before_its_step_goes(tmp_path: Path) -> None:
    """``save_total_limit=1``: at every moment a step stops being committed (its manifest is
    deleted), no folder names it any more; at the end one step and its folder are left."""
    root = tmp_path / "run"
    trainer = make_trainer(root, save_total_limit=1)
    storage = plugin_of(trainer).manager().storage
    delete, stale = storage.delete, []

    def watched(path: str) -> None:
        delete(path)
        named = {int(n.removeprefix("checkpoint-")) for n in _folders(root)}
        gone = named - set(committed_steps(storage))
        if gone:
            stale.append((path, sorted(gone)))

    storage.delete = watched  # type: ignore[method-assign]
    trainer.train()
    assert not stale, stale
    assert _steps(root) == [12] and _folders(root) == ["checkpoint-12"]


@pytest.mark.parametrize("where", ["output_dir", "url"])
def test_the_best_and_the_newest_keep_their_folders_past_the_trainers_own_cleanup(where: str, tmp_path: Path) -> None:
    """``save_total_limit=1`` with a best checkpoint: retention keeps the best and the newest
    step, and both keep their folders, though the Trainer's end of training deletes every
    ``checkpoint-*`` but the best (comparing them with ``os.path.samefile``, also with a URL
    root: ``best_model_checkpoint`` is the best step's local folder)."""
    out = tmp_path / "run"
    trainer = make_trainer(
        out,
        evaluate=True,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=SAVE_EVERY,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the highest eval loss: an early step
    )
    root = str(out) if where == "output_dir" else f"memory://sk-folders-{uuid.uuid4().hex[:12]}/run"
    if where == "url":
        enable(trainer, root=root)
    trainer.train()
    best = trainer.state.best_global_step
    assert best in (4, 8), best
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{best}")
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [best, STEPS]
    assert _folders(out) == [f"checkpoint-{best}", f"checkpoint-{STEPS}"]
    last = get_last_checkpoint(str(out))
    assert last == str(out / f"checkpoint-{STEPS}")
    assert json.loads((out / f"checkpoint-{STEPS}" / "shardkeeper.json").read_text())["root"] == root
    again = make_trainer(out, max_steps=STEPS)
    if where == "url":
        enable(again, root=root)
    again.train(resume_from_checkpoint=last)
    assert again.state.global_step == STEPS and again.losses == []


def test_a_folder_whose_step_was_deleted_as_damaged_is_refused_and_removed(
    tmp_path: Path, reference: tuple[Path, Any]
) -> None:
    """Step 12 damaged and deleted (``shardkeeper delete --damaged``, as the resume error says):
    its folder names a step that is gone; a resume from it is refused by name, the folder is
    removed, and ``get_last_checkpoint`` then names step 8, which resumes bit for bit."""
    from shardkeeper.core.cli import main

    ref_root, ref = reference
    root = tmp_path / "copy"
    shutil.copytree(ref_root, root)
    with CheckpointManager(root) as mgr:
        (data,) = sorted((Path(mgr.step_url(12)) / "data").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        make_trainer(root, **CONSTANT).train(resume_from_checkpoint=get_last_checkpoint(str(root)))
    assert main(["delete", str(root), "12", "--damaged"]) == 0
    stale = get_last_checkpoint(str(root))
    assert stale == str(root / "checkpoint-12")
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint-12 names step 12 .* not committed \(rank 0\)"):
        make_trainer(root, **CONSTANT).train(resume_from_checkpoint=stale)
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-8")
    resumed = make_trainer(root, **CONSTANT)
    resumed.train(resume_from_checkpoint=get_last_checkpoint(str(root)))
    _same_as_reference(resumed, ref, 8)


def test_a_damaged_pointer_is_refused_by_name_and_written_again(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """``checkpoint-12/shardkeeper.json`` overwritten: a resume from that folder is refused,
    naming the pointer, the rank and the remedy; ``train()`` writes the folder of the committed
    step 12 again, and a resume from it restores the state bit for bit."""
    from shardkeeper.core import CorruptCheckpointError

    ref_root, ref = reference
    root = tmp_path / "copy"
    shutil.copytree(ref_root, root)
    folder = root / "checkpoint-12"
    (folder / "shardkeeper.json").write_text("{ truncated")
    trainer = make_trainer(root, max_steps=STEPS)
    with pytest.raises(
        CorruptCheckpointError, match=r"checkpoint-12/shardkeeper.json is damaged: .* \(rank 0\): remove"
    ):
        trainer.train(resume_from_checkpoint=str(folder))
    assert json.loads((folder / "shardkeeper.json").read_text())["step"] == 12
    resumed = make_trainer(root, max_steps=STEPS, **CONSTANT)
    resumed.train(resume_from_checkpoint=str(folder))
    _same_as_reference(resumed, ref, STEPS)


def test_the_trainers_own_folder_is_left_as_it_is(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """A run that switches to shardkeeper in the same ``output_dir``: the Trainer's own
    ``checkpoint-4`` is resumed through its loaders and never touched; the later steps get
    shardkeeper's folders, so ``get_last_checkpoint`` names the newest."""
    _, ref = reference
    out = tmp_path / "run"
    args = TrainingArguments(
        output_dir=str(out),
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
    own = sorted(os.listdir(out / "checkpoint-4"))
    assert "shardkeeper.json" not in own
    resumed = make_trainer(out, **CONSTANT)
    resumed.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    _same_as_reference(resumed, ref, 4)
    assert sorted(os.listdir(out / "checkpoint-4")) == own
    assert _folders(out) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-12")


def test_a_folder_that_on_save_wrote_into_gets_the_pointer_and_goes_with_its_step(tmp_path: Path) -> None:
    """A callback's ``on_save`` that writes files into ``output_dir/checkpoint-N`` (as PEFT's
    ``SavePeftModelCallback`` does) runs before the step's async commit: the folder it made
    still gets the pointer and ``trainer_state.json`` beside its files once the step commits
    (not left as if the Trainer wrote it), and retention removes it with its step."""
    from transformers import TrainerCallback

    class SaveExtra(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "adapter_config.json").write_text(json.dumps({"step": state.global_step}))

    out = tmp_path / "run"
    trainer = make_trainer(out, save_total_limit=2, callbacks=[SaveExtra()], options={"async_save": True})
    trainer.train()
    assert _steps(out) == [8, 12]
    assert _folders(out) == ["checkpoint-8", "checkpoint-12"]
    for step in (8, 12):
        files = sorted(os.listdir(out / f"checkpoint-{step}"))
        assert files == ["adapter_config.json", "shardkeeper.json", "trainer_state.json"], (step, files)
        pointer = json.loads((out / f"checkpoint-{step}" / "shardkeeper.json").read_text())
        assert pointer["step"] == step
        assert json.loads((out / f"checkpoint-{step}" / "adapter_config.json").read_text()) == {"step": step}
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-12")
