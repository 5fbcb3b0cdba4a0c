"""Models, data and state digests shared by the Lightning tests and their worker scripts."""

from __future__ import annotations

import json
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_SAMPLES = 32
BATCH = 4


class Net(L.LightningModule):
    """A small MLP; ``mode`` says how configure_model() parallelizes it (fsdp2, tp, or none)."""

    def __init__(self, mode: str = "none", lr: float = 0.05) -> None:
        super().__init__()
        self.mode = mode
        self.lr = lr
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        elif self.mode == "tp":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(
                self.model, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.losses[self.trainer.global_step] = float(loss.detach())
        self.log("train_loss", loss, sync_dist=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class HNet(Net):
    """``Net`` whose constructor arguments are saved with ``save_hyperparameters()`` (what
    ``load_from_checkpoint`` rebuilds it from), with validation, test and predict steps."""

    def __init__(self, mode: str = "none", lr: float = 0.05, tag: str = "h") -> None:
        super().__init__(mode=mode, lr=lr)
        self.save_hyperparameters()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self.model(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", F.mse_loss(self.model(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = torch.randn(N_SAMPLES, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def _local(v: torch.Tensor) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(v, ShardedTensor):
        shards = v.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    return v


def full_state(lm: nn.Module, opt: torch.optim.Optimizer, full: bool = True) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state by FQN: full tensors (a collective under FSDP2/TP), or
    with ``full=False`` (FSDP1, whose full state dict crashes on CPU) this rank's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=full)
    out = {f"model/{k}": _local(v).detach().clone() for k, v in get_model_state_dict(lm, options=opts).items()}
    osd = get_optimizer_state_dict(lm, opt, options=opts)
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{fqn}/{name}"] = _local(v).detach().clone()
    return out


def dump(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def cpu_fsdp1_strategy() -> Any:
    """``FSDPStrategy`` (sharded state dicts) that wraps with ``device_id=cpu``: stock
    FSDPStrategy passes ``root_device.index`` (None on CPU), which FSDP1 refuses."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            return FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), **self.kwargs)

    return CPUFSDPStrategy(state_dict_type="sharded")


def cpu_deepspeed_strategy(stage: int) -> Any:
    """``DeepSpeedStrategy`` allowed on CPU (stock Lightning requires CUDA in
    ``setup_environment``; DeepSpeed itself runs on CPU with ``DS_ACCELERATOR=cpu``)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # without the CUDA device-index validation
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed  # as Lightning's, without args.device_rank (None on CPU)

            engine, opt, _, _ = deepspeed.initialize(
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            # Lightning 2.5.6 + DeepSpeed 0.18.9 on CPU: ZeRO-2's step all-gathers into views of a
            # split and fails ("Output 0 of Split is a view and is being modified inplace");
            # the engine's step under no_grad avoids it (test-only; not the plugin's business).
            if _old_deepspeed():
                step = engine.step

                def no_grad_step(*args: Any, **kwargs: Any) -> Any:
                    with torch.no_grad():
                        return step(*args, **kwargs)

                engine.step = no_grad_step
            return engine, opt

    return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo")


def _old_deepspeed() -> bool:
    import deepspeed

    return tuple(int(x) for x in deepspeed.__version__.split(".")[:2]) < (0, 19)


def cpu_trainer(tmp: Any, *plugins: Any, epochs: int = 1, callbacks: list[Any] | None = None) -> L.Trainer:
    """A quiet one-device CPU Trainer under ``tmp``; checkpointing only with ``callbacks``."""
    return L.Trainer(
        default_root_dir=str(tmp),
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=list(plugins),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks or [],
    )
