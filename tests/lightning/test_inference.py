"""Inference loads of the plugin's pointer files (``last.ckpt`` names a root and a step):
``LightningModule.load_from_checkpoint``, ``LightningDataModule.load_from_checkpoint``,
``trainer.test/validate/predict(ckpt_path=...)`` with and without the plugin, and
``shardkeeper.lightning.load_checkpoint``; plain ``.ckpt`` files still load as Lightning loads
them, and a pointer whose root or step is gone fails naming the pointer, root and step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import shardkeeper.lightning as skl
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.pointer import pointer_document
from shardkeeper.lightning.paths import write_pointer
from tests.checks import assert_same_state
from tests.lightning.common import HNet, cpu_trainer, loader


class DataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> Any:
        return loader()


class Wider(HNet):
    """HNet with one more parameter than the checkpoint holds (``strict`` matters)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.extra = torch.nn.Parameter(torch.zeros(3))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run saved through the plugin: ModelCheckpoint's last.ckpt, and the state it names."""
    tmp = tmp_path_factory.mktemp("inference")
    L.seed_everything(0)
    net = HNet(lr=0.01, tag="run")
    plugin = skl.ShardkeeperCheckpointIO(tmp / "root")
    t = cpu_trainer(tmp, plugin, callbacks=[ModelCheckpoint(dirpath=tmp / "ck", save_last=True)])
    t.fit(net, datamodule=DataModule(batch_size=4, seed=7))
    opt = t.optimizers[0].state_dict()
    return {
        "tmp": tmp,
        "pointer": tmp / "ck" / "last.ckpt",
        "root": tmp / "root",
        "step": t.global_step,
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
        "param_groups": opt["param_groups"],
    }


def test_load_from_checkpoint_restores_weights_and_hparams_from_a_pointer(run: dict[str, Any]) -> None:
    assert pointer_document(run["pointer"].read_bytes())["step"] == run["step"]  # a pointer, not a torch file
    L.seed_everything(5)  # a fresh module's init differs from the saved weights
    lm = HNet.load_from_checkpoint(run["pointer"])
    assert dict(lm.hparams) == {"mode": "none", "lr": 0.01, "tag": "run"}
    assert_same_state(lm.state_dict(), run["state"], what="load_from_checkpoint(last.ckpt)")
    assert all(p.device.type == "cpu" for p in lm.parameters())
    lm = HNet.load_from_checkpoint(str(run["pointer"]), map_location="cpu", tag="override")
    assert lm.hparams.tag == "override" and lm.hparams.lr == 0.01  # kwargs override saved hparams
    assert_same_state(lm.state_dict(), run["state"], what="load_from_checkpoint(map_location='cpu')")
    assert_same_state(
        HNet.load_from_checkpoint(run["pointer"], map_location={"cpu": "cpu"}).state_dict(), run["state"], what="dict"
    )


def test_strict_applies_as_for_a_ckpt(run: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"extra\""):
        Wider.load_from_checkpoint(run["pointer"])
    with pytest.warns(UserWarning, match="not in the checkpoint: \\['extra'\\]"):
        lm = Wider.load_from_checkpoint(run["pointer"], strict=False)
    assert torch.equal(lm.extra, torch.zeros(3))
    assert_same_state({k: v for k, v in lm.state_dict().items() if k != "extra"}, run["state"], what="strict=False")


def test_datamodule_load_from_checkpoint_reads_its_hparams(run: dict[str, Any]) -> None:
    dm = DataModule.load_from_checkpoint(run["pointer"])
    assert dict(dm.hparams) == {"batch_size": 4, "seed": 7}


def test_load_checkpoint_returns_lightnings_dict_of_cpu_tensors(run: dict[str, Any]) -> None:
    ck = skl.load_checkpoint(run["pointer"])
    assert ck["global_step"] == run["step"] and ck["epoch"] == 0
    assert ck["hyper_parameters"] == {"mode": "none", "lr": 0.01, "tag": "run"}
    assert_same_state(ck["state_dict"], run["state"], what="load_checkpoint(...)['state_dict']")
    (opt,) = ck["optimizer_states"]  # torch's index-keyed form, loadable into the optimizer
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in run["param_groups"]]
    assert [g["lr"] for g in opt["param_groups"]] == [g["lr"] for g in run["param_groups"]]
    assert list(opt["state"]) == list(run["optim"]) == sorted(run["optim"])  # ascending, as torch orders it
    for i, s in run["optim"].items():
        assert_same_state(opt["state"][i], s, what=f"optimizer state of parameter {i}")
    assert ck["lr_schedulers"] and "loops" in ck and "callbacks" in ck
    for path in (run["root"], run["root"] / f"step-{run['step']:012d}"):  # the newest step, a step directory
        assert_same_state(skl.load_checkpoint(path)["state_dict"], run["state"], what=f"load_checkpoint({path})")
    net = HNet()
    optim = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    optim.load_state_dict(opt)
    with pytest.raises(CheckpointNotFoundError, match="neither a shardkeeper pointer"):
        skl.load_checkpoint(run["tmp"] / "ck")


@pytest.mark.parametrize("with_plugin", [False, True])
def test_trainer_test_validate_predict_from_a_pointer(run: dict[str, Any], tmp_path: Path, with_plugin: bool) -> None:
    plugins = [skl.ShardkeeperCheckpointIO(tmp_path / "other-root")] if with_plugin else []
    t = cpu_trainer(tmp_path, *plugins)
    for call in (t.test, t.validate):
        L.seed_everything(9)
        net = HNet()
        call(net, dataloaders=loader(), ckpt_path=str(run["pointer"]))
        assert_same_state(net.state_dict(), run["state"], what=f"{call.__name__}(ckpt_path=last.ckpt)")
    net = HNet()
    out = t.predict(net, dataloaders=loader(), ckpt_path=str(run["pointer"]))
    assert_same_state(net.state_dict(), run["state"], what="predict(ckpt_path=last.ckpt)")
    assert out is not None and len(out) == 8


def test_a_plain_ckpt_still_loads_as_lightning_loads_it(tmp_path: Path) -> None:
    L.seed_everything(0)
    net = HNet(tag="plain")
    t = cpu_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    t.fit(net, loader())
    path = tmp_path / "ck" / "last.ckpt"
    assert os.path.getsize(path) > 1024  # Lightning's own torch file
    lm = HNet.load_from_checkpoint(path)
    assert lm.hparams.tag == "plain"
    assert_same_state(lm.state_dict(), net.state_dict(), what="a plain .ckpt")
    t2 = cpu_trainer(tmp_path)
    net2 = HNet()
    t2.test(net2, dataloaders=loader(), ckpt_path=str(path))
    assert_same_state(net2.state_dict(), net.state_dict(), what="trainer.test(plain .ckpt)")


def test_uninstall_gives_lightning_its_loader_back(run: dict[str, Any]) -> None:
    from lightning.fabric.plugins.io import torch_io
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    assert all(hasattr(f, "__wrapped__") for f in (saving.pl_load, torch_io.pl_load, cloud_io._load))
    skl.uninstall()
    try:
        assert saving.pl_load is torch_io.pl_load is cloud_io._load
        assert not hasattr(cloud_io._load, "__wrapped__")
        # Lightning's own loader: the pointer's torch view, whose state_dict names what it is
        with pytest.raises(RuntimeError, match=r"Unexpected key.*This file is a shardkeeper pointer.*step \d+ of"):
            HNet.load_from_checkpoint(run["pointer"])
        assert_same_state(skl.load_checkpoint(run["pointer"])["state_dict"], run["state"], what="uninstalled")
    finally:
        skl.install()
    assert_same_state(HNet.load_from_checkpoint(run["pointer"]).state_dict(), run["state"], what="reinstalled")


def test_a_pointer_whose_root_or_step_is_gone_names_pointer_root_and_step(run: dict[str, Any], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(run["root"], copy / "root")
    (copy / "ck").mkdir()
    write_pointer(str(copy / "ck" / "gone.ckpt"), str(copy / "root"), 999)
    with pytest.raises(
        CheckpointNotFoundError, match=r"gone\.ckpt names step 999 under root .*copy/root, which has no"
    ):
        HNet.load_from_checkpoint(copy / "ck" / "gone.ckpt")
    write_pointer(str(copy / "ck" / "last.ckpt"), str(copy / "root"), run["step"])
    shutil.rmtree(copy / "root")
    step = f"step {run['step']} under root {copy / 'root'}, which does not exist"
    with pytest.raises(CheckpointNotFoundError, match=rf"last\.ckpt names {step}.*Copy or move the root back"):
        HNet.load_from_checkpoint(copy / "ck" / "last.ckpt")
    with pytest.raises(CheckpointNotFoundError, match=rf"last\.ckpt names {step}"):
        cpu_trainer(tmp_path).test(HNet(), dataloaders=loader(), ckpt_path=str(copy / "ck" / "last.ckpt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_two_rank_ddp_or_fsdp2_save_loads_whole_in_one_process(tmp_path: Path) -> None:
    """The checkpoint of a 2-process ddp or ModelParallel (FSDP2, dp=2) run, read here in one
    process without a process group: full tensors, bit for bit as the run held them."""
    from safetensors.torch import load_file

    from tests.launch import run_script

    proc = run_script(2, Path(__file__).parent / "dist" / "save_for_inference.py", str(tmp_path), timeout_s=240)
    assert proc.returncode == 0 and 'RESULT {"saved": true}' in proc.stdout, proc.stdout[-6000:]
    for name in ("ddp", "fsdp2"):
        ref = load_file(str(tmp_path / name / "ref.safetensors"))
        pointer = tmp_path / name / "ckpts" / "last.ckpt"
        lm = HNet.load_from_checkpoint(pointer, mode="none")  # FSDP2's configure_model needs a mesh: not here
        assert lm.hparams.tag == name and lm.hparams.lr == 0.03
        model = {k: v for k, v in ref.items() if k.startswith("model/")}
        assert_same_state({f"model/{k}": v for k, v in lm.state_dict().items()}, model, what=f"{name} weights")
        (opt,) = skl.load_checkpoint(pointer)["optimizer_states"]
        names = [n for n, _ in lm.named_parameters()]
        got = {f"optim/{names[i]}/{k}": v for i, s in opt["state"].items() for k, v in s.items()}
        assert_same_state(got, {k: v for k, v in ref.items() if k.startswith("optim/")}, what=f"{name} AdamW state")
