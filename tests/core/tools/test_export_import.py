"""Export to Hugging Face safetensors and import from torch.distributed.checkpoint.

One 2-rank FSDP2 launch writes a sharded shardkeeper checkpoint, a DCP checkpoint of the same
state, one with int8-quantized moments, and the full reference state; the tests export the
first, import the second, restore the third at one rank, and compare with the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.errors import ChecksumMismatchError, CommitConflictError, StateMismatchError
from shardkeeper.core.state.quantize import dequantize_int8, quantize_int8, quantized
from shardkeeper.core.storage import open_storage
from shardkeeper.core.tools.dcp_import import import_dcp
from shardkeeper.core.tools.export import INDEX_NAME, export_safetensors, parse_size
from shardkeeper.core.util.bars import make_bar
from tests.checks import assert_checks, assert_same_state, read_checks
from tests.conftest import StorageRoot

from .._launch import run_workers
from ..dist.layouts import build, full_state

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:unpickling .* \\(trust_pickle=True\\)"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("import_export")
    res = run_workers(2, "import_export_worker.py", str(out), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    return out


def _load_export(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        part = load_file(str(d / f))
        assert all(index["weight_map"][k] == f for k in part)
        out.update(part)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


@pytest.mark.multiprocess
def test_export_of_a_two_rank_checkpoint_loads_bit_for_bit(saved: Path, tmp_path: Path) -> None:
    ref = load_file(str(saved / "ref.safetensors"))
    want = {k.removeprefix("model/"): v for k, v in ref.items() if k.startswith("model/")}
    # 1 MB shards: the 3 MiB weight gets a shard of its own, the rest share one
    res = export_safetensors(saved / "sk", to=tmp_path / "hf", max_shard_size="1MB")
    assert res.step == 2 and len(res.files) >= 2
    timings = load_manifest(open_storage(str(saved / "sk")), 2).metadata["timings"]
    assert timings["sync"] is True and timings["write_s"] > 0 and timings["save_s"] >= timings["commit_s"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted([*res.files, INDEX_NAME])
    assert_same_state(_load_export(tmp_path / "hf"), want)
    with safe_open(str(tmp_path / "hf" / res.files[0]), "pt") as f:
        assert f.metadata()["format"] == "pt"  # transformers refuses shards without it


@pytest.mark.multiprocess
def test_export_selected_keys_with_prefix_through_the_cli(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = load_file(str(saved / "ref.safetensors"))
    want = {k: v for k, v in ref.items() if k.startswith("optim/state/fc1.")}
    rc = main(
        [
            "export",
            str(saved / "sk"),
            "2",
            "--to",
            str(tmp_path / "o"),
            "--keys",
            "optim/state/fc1.*",
            "--keep-prefix",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "exported step 2" in capsys.readouterr().out
    assert_same_state(_load_export(tmp_path / "o"), want)
    rc = main(["export", str(saved / "sk"), "--to", str(tmp_path / "x"), "--keys", "nothing/*"])
    assert rc == 2 and "no tensor leaf matches nothing/*" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_export_refuses_damaged_bytes(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "sk"
    shutil.copytree(saved / "sk", root)
    m = load_manifest(open_storage(str(root)), 2)
    chunk = m.leaves["model/big.weight"].chunks[-1]
    path = root / "step-000000000002" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length - 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="model/big.weight"):
        export_safetensors(root, 2, to=tmp_path / "hf", max_shard_size=1 << 20)
    # nothing that looks complete, no half-written shard, and the folder takes the next export
    assert list((tmp_path / "hf").iterdir()) == []


@pytest.mark.multiprocess
def test_import_of_fsdp2_dcp_restores_bit_for_bit_at_one_rank(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "imported"
    # 1 MiB batches: the import streams the state in several shard files
    m = import_dcp(saved / "dcp", root, step=7, trust_pickle=True, batch_bytes=1 << 20, progress=False)
    assert m.step == 7 and len(m.files) >= 2
    assert m.leaves["progress/step"].value == 2
    model, opt = build("plain", seed=5)
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": model, "optim": opt, "progress": {"step": 0}}) == 7
    ref = load_file(str(saved / "ref.safetensors"))
    assert_same_state(full_state(model, opt), ref)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(CommitConflictError):
        import_dcp(saved / "dcp", root, step=7, trust_pickle=True, progress=False)


@pytest.mark.multiprocess
def test_import_needs_trust_pickle(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PermissionError, match="trust_pickle=True"):
        import_dcp(saved / "dcp", tmp_path / "r", step=1)
    rc = main(["import", str(saved / "dcp"), str(tmp_path / "r"), "--step", "1"])
    assert rc == 2 and "--trust-pickle" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    rc = main(["import", str(saved / "dcp"), str(tmp_path / "r"), "--step", "1", "--trust-pickle", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert "imported" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "r")]) == 0


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="5GB"):
        parse_size("lots")


def test_export_without_tensors_is_a_clear_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, {"w": torch.ones(3)}, async_save=False)
    with pytest.raises(StateMismatchError, match="no tensor leaf matches model/"):
        export_safetensors(tmp_path / "r", to=tmp_path / "o")
    res = export_safetensors(tmp_path / "r", to=tmp_path / "o", keys=["*"])
    assert torch.equal(load_file(str(tmp_path / "o" / res.files[0]))["w"], torch.ones(3))


@pytest.mark.multiprocess
def test_int8_moments_restore_into_fsdp2_at_two_ranks(saved: Path) -> None:
    checks = read_checks(*(saved / f"q-restore-r{rank}.json" for rank in (0, 1)))
    assert_checks(checks, ["int8 restore at 2 ranks: parameters exact, moments their int8 round trip"])


@pytest.mark.multiprocess
def test_int8_moments_saved_by_two_fsdp2_ranks_restore_at_one(saved: Path) -> None:
    ref = load_file(str(saved / "ref.safetensors"))
    model, opt = build("plain", seed=9)
    with CheckpointManager(saved / "q") as mgr:
        mgr.restore({"model": model, "optim": quantized(opt, model, mode="int8", block=48)})
    want = {}
    for k, v in ref.items():
        name = k.rsplit("/", 1)[-1]
        if not (k.startswith("model/") or name == "step" or v.dim() < 2):
            # blocks run along rows, so the per-shard codes equal those of the whole tensor
            root = name == "exp_avg_sq"
            v = dequantize_int8(*quantize_int8(v, 48, root), 48, root, torch.float32)
        want[k] = v
    assert_same_state(full_state(model, opt), want, what="the int8 checkpoint restored at one rank")


def test_export_and_import_on_every_backend(storage_root: StorageRoot, tmp_path: Path) -> None:
    """Export reads from, and import writes to, local disk, S3 (moto, SeaweedFS) and GCS."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    w = {"a.weight": torch.randn(40, 33), "a.bias": torch.randn(33).to(torch.bfloat16)}
    with CheckpointManager(storage_root.url, storage_options=storage_root.options, digest_block_bytes=1000) as mgr:
        mgr.save(4, {"model": dict(w)}, async_save=False)
    res = export_safetensors(storage_root.url, storage_options=storage_root.options, to=tmp_path / "hf", progress=False)
    assert res.step == 4
    assert_same_state(_load_export(tmp_path / "hf"), w)
    dcp.save({"model": dict(w)}, checkpoint_id=str(tmp_path / "dcp"))
    import_dcp(
        tmp_path / "dcp",
        storage_root.url,
        step=9,
        trust_pickle=True,
        storage_options=storage_root.options,
        progress=False,
    )
    back = {k: torch.zeros_like(v) for k, v in w.items()}
    with CheckpointManager(storage_root.url, storage_options=storage_root.options) as mgr:
        assert mgr.restore({"model": back}) == 9
    assert_same_state(back, w)


def test_progress_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """The bar (tqdm's, core/util/bars.py) goes to stderr when enabled, nowhere when not."""
    bar = make_bar(3 << 20, "export step 1", enabled=True)
    bar.update(3 << 20)
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "export step 1" in err and "100%" in err and "3.00M/3.00M" in err
    quiet = make_bar(10, "x", enabled=False)
    quiet.update(10)
    quiet.close()
    assert capsys.readouterr() == ("", "")


def test_export_of_a_compressed_incremental_checkpoint(tmp_path: Path) -> None:
    """zstd chunks are decoded after their stored bytes are verified; references into an
    earlier step's files are followed."""
    pytest.importorskip("zstandard", reason="compression needs the [zstd] extra")
    torch.manual_seed(4)
    w = {"zeros": torch.zeros(300, 64), "b": torch.randn(100, 7), "h": torch.randn(64, 3).to(torch.bfloat16)}
    with CheckpointManager(tmp_path / "r", compression="zstd", incremental=True) as mgr:
        mgr.save(1, {"model": dict(w)}, async_save=False)
        w["b"] = w["b"] + 1
        mgr.save(2, {"model": dict(w)}, async_save=False)
    m = load_manifest(open_storage(str(tmp_path / "r")), 2)
    chunks = [c for k in m.leaves if m.leaves[k].kind == "tensor" for c in m.leaves[k].chunks]
    assert any(c.encoding != "raw" for c in chunks) and any(c.file.startswith("../") for c in chunks)
    export_safetensors(tmp_path / "r", 2, to=tmp_path / "hf", progress=False)
    assert_same_state(_load_export(tmp_path / "hf"), w)
