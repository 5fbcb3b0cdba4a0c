"""``import_lightning_checkpoint`` unpickles nothing unless ``trust_pickle is True``.

A ``.ckpt`` written by a real Trainer, and a sharded directory (DCP files and ``meta.pt``, as
``FSDPStrategy(state_dict_type="sharded")`` writes them), each with a payload that creates a
folder when unpickled. Every value but True is refused before anything is read, with nothing
created and no claim of unpickling; True reads the payloads and imports.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.hostile_pickle import UNTRUSTED, Trace

L = pytest.importorskip("lightning")

from tests.lightning.common import Net, loader  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed.checkpoint")]


def _ckpt(tmp_path: Path) -> tuple[Path, list[Path]]:
    path, trace = tmp_path / "last.ckpt", tmp_path / "trace-ckpt"
    trainer = L.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), loader())
    trainer.save_checkpoint(path)  # Lightning's own .ckpt, one entry added
    ck = torch.load(path, weights_only=False)
    ck["trace"] = Trace(trace)
    torch.save(ck, path)
    return path, [trace]


def _sharded(tmp_path: Path) -> tuple[Path, list[Path]]:
    import torch.distributed.checkpoint as dcp

    src, traces = tmp_path / "sharded.ckpt", [tmp_path / "trace-meta", tmp_path / "trace-metadata"]
    net = Net()
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(src))
    torch.save(
        {"global_step": 4, "epoch": 0, "pytorch-lightning_version": L.__version__, "trace": Trace(traces[0])},
        src / "meta.pt",
    )
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.__dict__["trace"] = Trace(traces[1])
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return src, traces


KINDS = {"ckpt": _ckpt, "sharded": _sharded}


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_unpickles_nothing_unless_trust_is_true(tmp_path: Path, kind: str) -> None:
    from shardkeeper.lightning import import_lightning_checkpoint

    src, traces = KINDS[kind](tmp_path)
    root = tmp_path / "root"
    for trust in UNTRUSTED:
        with warnings.catch_warnings(record=True) as seen, pytest.raises(PermissionError) as refused:
            warnings.simplefilter("always")
            import_lightning_checkpoint(src, root, trust_pickle=trust)  # type: ignore[arg-type]
        assert not any(t.exists() for t in traces), (trust, refused.value)
        assert str(refused.value).startswith(f"{src}: ") and "trust_pickle=True" in str(refused.value), refused.value
        assert not [w for w in seen if "unpickling" in str(w.message)], (trust, [str(w.message) for w in seen])
        assert not root.exists()
    with pytest.warns(UserWarning, match="unpickling"):
        step = import_lightning_checkpoint(src, root, module=Net(), trust_pickle=True)
    assert all(t.is_dir() for t in traces)  # the payloads are live
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [step] and "model/model.0.weight" in mgr.manifest(step).leaves
