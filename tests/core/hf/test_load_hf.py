"""Start from Hugging Face weights: ``load_hf`` and ``shardkeeper import`` of a safetensors folder.

The folder is written in the test with the ``safetensors`` package as ``save_pretrained`` writes
it (three shards and an index, bfloat16 and float32 tensors, the tied ``lm_head.weight`` left
out: ``tests/core/_hf.py``). Loads are compared bit for bit with the written tensors; reads are
counted by a storage that counts them. Two gloo ranks load into FSDP2 (``dist/hf_load_worker.py``).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, import_hf, load_hf
from shardkeeper.core.cli import main
from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from tests.checks import assert_checks, read_checks

from .._hf import INDEX, CountingStorage, TinyLM, same_bits, weights, write_folder
from .._launch import run_workers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = weights(TinyLM(seed=0))
    return write_folder(src, tmp_path / "hf"), src


def _assert_loaded(model: TinyLM, src: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        want = src["model.embed_tokens.weight"] if k == "lm_head.weight" else src[k]
        assert same_bits(v, want), k


def test_a_plain_model_loads_bit_for_bit_reading_only_its_bytes(folder: tuple[Path, dict]) -> None:
    path, src = folder
    model = TinyLM(seed=1)
    got = load_hf(path, model)
    _assert_loaded(model, src)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds: filled through its twin
    assert set(got.keys) == {f"model/{k}" for k in src} and got.unused == []
    total = sum(t.numel() * t.element_size() for t in src.values())
    assert got.stats.bytes_read == got.stats.bytes_needed == total  # ranged reads: nothing more


def test_rename_and_dtype_cast(folder: tuple[Path, dict]) -> None:
    path, src = folder
    blocks = {k.replace("model.layers.", "blocks."): torch.zeros(v.shape) for k, v in src.items()}  # all float32
    with pytest.raises(StateMismatchError, match="dtype=True"):
        load_hf(path, blocks, rename=lambda k: k.replace("model.layers.", "blocks."))
    assert not any(t.any() for t in blocks.values())  # refused before a byte was read
    load_hf(path, blocks, rename=lambda k: k.replace("model.layers.", "blocks."), dtype=True)
    for k, v in src.items():
        assert same_bits(blocks[k.replace("model.layers.", "blocks.")], v.float()), k
    # a mapping renames the names it lists; dtype=<the target's dtype> casts into that dtype only
    target = {"final_norm": torch.zeros(128), "q": torch.zeros(128, 128)}
    load_hf(
        path,
        target,
        rename={"model.norm.weight": "final_norm", "model.layers.0.q_proj.weight": "q"},
        only=["model.norm.weight", "model.layers.0.q_proj.weight"],
        dtype=torch.float32,
    )
    assert same_bits(target["final_norm"], src["model.norm.weight"])
    assert same_bits(target["q"], src["model.layers.0.q_proj.weight"].float())
    with pytest.raises(StateMismatchError, match="another dtype"):
        load_hf(path, {"q": torch.zeros(128, 128, dtype=torch.float16)}, rename={"model.layers.0.q_proj.weight": "q"},
                only="model.layers.0.q_proj.weight", dtype=torch.float32)  # fmt: skip


def test_a_tied_weight_the_file_omits_is_declared(folder: tuple[Path, dict]) -> None:
    path, src = folder
    untied = TinyLM(seed=1, tie=False)
    with pytest.raises(StateMismatchError, match=r"lm_head\.weight.*tied="):
        load_hf(path, untied)
    got = load_hf(path, untied, tied={"lm_head.weight": "model.embed_tokens.weight"})
    _assert_loaded(untied, src)
    assert got.keys["model/lm_head.weight"] == "model.embed_tokens.weight"
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_unused_lists_what_fills_nothing_not_what_rename_dropped(folder: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, src = folder
    target = {k: torch.zeros_like(v) for k, v in src.items() if not k.startswith("model.layers.1.")}
    del target["model.norm.bias"]  # in the folder, kept by rename, filling nothing: unused
    got = load_hf(path, target, rename=lambda k: None if k.startswith("model.layers.1.") else k)
    assert got.unused == ["model.norm.bias"]
    assert set(got.keys) == set(target) and all(same_bits(v, src[k]) for k, v in target.items())


def test_only_reads_the_files_that_hold_the_selection(folder: tuple[Path, dict]) -> None:
    path, src = folder
    index = json.loads((path / INDEX).read_text())["weight_map"]
    model, before = TinyLM(seed=1), TinyLM(seed=1).state_dict()
    storage = CountingStorage(path)
    got = load_hf(storage, model, only="model.layers.1.*")
    chosen = {k for k in src if k.startswith("model.layers.1.")}
    assert set(got.keys.values()) == chosen
    for k, v in model.state_dict().items():
        assert same_bits(v, src[k] if k in chosen else before[k]), k
    assert set(storage.by_file) == {INDEX} | {index[k] for k in chosen}  # no other shard opened
    with pytest.raises(StateMismatchError, match="matches no tensor"):
        load_hf(path, model, only="model.layers.9.*")


def test_a_hub_cache_folder_is_read_through_its_links(folder: tuple[Path, dict], tmp_path: Path) -> None:
    path, src = folder
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p.name for p in path.iterdir())):
        shutil.copy(path / f, repo / "blobs" / f"blob{i}")
        (snap / f).symlink_to(f"../../blobs/blob{i}")
    for where in (repo, snap):
        model = TinyLM(seed=1)
        load_hf(where, model)
        _assert_loaded(model, src)


def _forge(path: Path, file: str, edit) -> None:  # type: ignore[no-untyped-def]
    raw = (path / file).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header, data = edit(header, raw[8 + n :])
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    (path / file).write_bytes(struct.pack("<Q", len(text)) + text + data)


def _nth(header: dict, i: int) -> str:
    """The name of the ``i``-th tensor of ``header`` by its place in the file."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[i]


def _set(header: dict, i: int, **entry: object) -> dict:
    name = _nth(header, i)
    return {**header, name: {**header[name], **entry}}


def _shifted(header: dict) -> dict:
    """The second tensor moved 2 bytes back, into the first (its size kept)."""
    begin, end = header[_nth(header, 1)]["data_offsets"]
    return _set(header, 1, data_offsets=[begin - 2, end - 2])


FORGERIES = {
    "truncated": (lambda h, d: (h, d[:-3]), "truncated"),
    "overlap": (lambda h, d: (_shifted(h), d), "without gap or overlap"),
    "wrong size": (lambda h, d: (_set(h, 0, data_offsets=[0, 0]), d), "hold 0 bytes"),
    "out of the file": (lambda h, d: (_set(h, 0, data_offsets=[0, len(d) + 64]), d), "leave the data section"),
    "bad shape": (lambda h, d: (_set(h, 0, shape=[-1]), d), "non-negative"),
    "not JSON": (lambda h, d: ("{", d), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_a_forged_or_truncated_header_is_a_clear_error_before_any_read(folder: tuple[Path, dict], case: str) -> None:
    path, _ = folder
    file = "model-00001-of-00003.safetensors"
    edit, message = FORGERIES[case]
    _forge(path, file, edit)
    model, before = TinyLM(seed=1), TinyLM(seed=1).state_dict()
    with pytest.raises(CorruptCheckpointError, match=message) as err:
        load_hf(path, model)
    assert f"{file} (rank 0)" in str(err.value) and "download it again" in str(err.value)
    assert all(same_bits(v, before[k]) for k, v in model.state_dict().items())


def test_header_length_index_and_folder_errors(folder: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = folder
    file = path / "model-00002-of-00003.safetensors"
    file.write_bytes(struct.pack("<Q", 1 << 40) + file.read_bytes()[8:])
    with pytest.raises(CorruptCheckpointError, match="header length .* does not fit"):
        load_hf(path, TinyLM(seed=1))
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="not a path inside the folder"):
        load_hf(path, TinyLM(seed=1))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="neither model.safetensors nor"):
        load_hf(tmp_path / "empty", TinyLM(seed=1))


def test_a_dtype_the_format_lacks_is_named(tmp_path: Path) -> None:
    header = json.dumps({"scale": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(StateMismatchError, match=r"'scale' \(F8_E8M0\).*quantized"):
        load_hf(tmp_path, {"scale": torch.zeros(4, dtype=torch.uint8)})


def test_import_cli_makes_step_zero_bit_for_bit(folder: tuple[Path, dict], tmp_path: Path) -> None:
    path, src = folder
    root = tmp_path / "root"
    assert main(["import", str(path), str(root), "--step", "0", "--no-progress"]) == 0
    assert main(["verify", str(root)]) == 0
    model = TinyLM(seed=1)
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": model}) == 0
        loaded = mgr.load()["model"]
    _assert_loaded(model, src)
    assert set(loaded) == set(src) and all(same_bits(loaded[k], v) for k, v in src.items())
    assert main(["import", str(path), str(root), "--step", "0", "--no-progress"]) == 2  # committed: refused
    optim = torch.optim.AdamW(model.parameters())  # a training loop's state: the import holds weights alone
    with (
        CheckpointManager(root) as mgr,
        pytest.raises(StateMismatchError, match=r"was imported from .*only=\['model/\*'\]"),
    ):
        mgr.restore({"model": model, "optim": optim})
    m = import_hf(path, root, step=1, prefix="w/", only="model.norm.*", batch_bytes=1, progress=False)
    assert set(m.leaves) == {"w/model.norm.weight", "w/model.norm.bias"} and len(m.files) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_ranks_load_fsdp2_shards_and_deduplicate_replicas(folder: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = folder
    res = run_workers(2, "hf_load_worker.py", str(path), str(tmp_path / "results"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(2)), output=res.stdout)
    assert_checks(
        checks,
        {
            "fsdp2: bit for bit",
            "fsdp2: bytes read <= 1.1 x the rank's share",
            "replicated: bit for bit",
            "replicated: bytes read over the ranks <= 1.1 x the folder",
        },
    )
    print("\n".join(line for line in res.stdout.splitlines() if line.startswith("hf_load")))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_replicas_load_in_bounded_memory_and_the_environment_turns_sharing_off(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    src = {"embed.weight": torch.randn(4096, 1536, generator=gen)}  # 24 MiB: read in parts
    src |= {f"layers.{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(10)}  # 4 MiB each
    src["norm.weight"] = torch.randn(1024, generator=gen)
    path = write_folder(src, tmp_path / "hf")
    env = {"SHARDKEEPER_SHARE_RESTORE_READS": ""}  # unset (the worker sets it for its second load)
    res = run_workers(2, "hf_share_worker.py", str(path), str(tmp_path / "results"), timeout_s=240, env=env)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(2)), output=res.stdout)
    assert_checks(
        checks,
        {
            "shared: bit for bit",
            "shared: peers sent bytes",
            "shared: peak RSS <= 1.4 x the model",
            "unshared: bit for bit",
            "unshared: every rank reads all it loads, receives nothing",
        },
    )
    print("\n".join(line for line in res.stdout.splitlines() if line.startswith("hf_share")))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_a_folder_of_pickled_weights_is_named_with_the_remedy(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / name).write_bytes(b"\x80\x02not unpickled")
    with pytest.raises(CheckpointNotFoundError, match=rf"{name}.*pickle.*never unpickles.*save_pretrained"):
        load_hf(legacy, TinyLM(seed=1))
    with pytest.raises(CheckpointNotFoundError, match=rf"{name}.*save_pretrained"):
        import_hf(legacy, tmp_path / "root", step=0, progress=False)
    for trust in ([], ["--trust-pickle"]):  # the CLI names the folder as it is, not as a DCP directory
        assert main(["import", str(legacy), str(tmp_path / "root"), "--step", "0", "--no-progress", *trust]) == 2
        err = capsys.readouterr().err
        assert name in err and "save_pretrained" in err and "torch.distributed.checkpoint" not in err, err
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_an_index_that_names_a_missing_or_odd_file_and_a_bad_ref_are_named(
    folder: tuple[Path, dict], tmp_path: Path
) -> None:
    """An index whose shard is gone, an index that maps a tensor to no file name, and a Hub
    cache whose ``refs/main`` names no revision folder: each names the file at fault and the
    remedy, and the model is untouched."""
    path, _ = folder
    model, before = TinyLM(seed=1), TinyLM(seed=1).state_dict()
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"names model-00002-of-00003.safetensors.*which the folder lacks"):
        load_hf(path, model)
    assert all(same_bits(v, before[k]) for k, v in model.state_dict().items())
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = 5
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"maps 'model.norm.weight' to 5, not a file name"):
        load_hf(path, model)
    repo = tmp_path / "models--org--tiny"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("../../etc")
    with pytest.raises(CheckpointNotFoundError, match=r"refs/main names '../../etc', not a revision"):
        load_hf(repo, model)
