"""Client-side encryption (``encryption=``): AES-256-GCM data files in 64 KiB blocks under
per-file data keys wrapped by a key-encryption key, HMAC-authenticated manifests. Round trips
bit for bit on every backend (with compression, incremental references and partial reads);
a wrong or missing key, a tampered, swapped or truncated block, a tampered header or manifest
are clear errors, never garbage tensors; no plaintext reaches storage."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import (
    CheckpointManager,
    ChecksumMismatchError,
    CorruptCheckpointError,
    EncryptionKeyError,
    LocalKeyProvider,
)
from shardkeeper.core.codec.crypto import EncryptedStorage
from shardkeeper.core.codec.crypto_format import BLOCK, MAGIC, TAG
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify.root import verify_root
from shardkeeper.core.verify.step import verify_step
from tests.checks import assert_same_state

pytest.importorskip("cryptography")
pytestmark = pytest.mark.timeout(300)

KEK = bytes(range(32))
MARKER = b"PLAINTEXT-MARKER-0123456789"


def _keys(kek: bytes = KEK) -> LocalKeyProvider:
    return LocalKeyProvider(kek, "the test key")


def _state(seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "frozen": torch.arange(300_000, dtype=torch.int64).reshape(600, 500),  # 2.4 MB, a known pattern
        "w": torch.randn(256, 300, generator=g),  # changes between saves
        "zeros": torch.zeros(512, 512),  # compresses
        "blob": MARKER * 2000,  # a bytes leaf
        "step": seed,
    }


def _target(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: torch.full_like(v, 3) for k, v in state.items() if isinstance(v, torch.Tensor)}
    out["blob"] = b""
    out["step"] = 0
    return out


def _data_files(storage: Any, step: int) -> list[str]:
    d = f"{step_dir(step)}/data"
    return sorted(f"{d}/{n}" for n in storage.list_dir(d))


def test_encrypted_round_trip_on_every_backend(storage_root) -> None:
    """Two async saves with compression and incremental reuse: the second references the
    first's unchanged chunk; both restore bit for bit, also partially; every stored data file
    is ciphertext (no marker, no run of the known tensor's bytes); verify passes with the key
    (tags and digests) and without it (structure)."""
    pytest.importorskip("zstandard")
    plain = storage_root.open()
    s1, s2 = _state(1), _state(2)
    with CheckpointManager(
        storage_root.url, storage_options=storage_root.options, encryption=_keys(), compression="zstd", incremental=True
    ) as mgr:
        mgr.save(1, s1)
        mgr.save(2, s2)
        mgr.wait()
        m2 = json.loads(plain.read_bytes(f"{step_dir(2)}/manifest.json"))
        assert m2["encryption"]["algorithm"] == "AES-256-GCM"
        assert {c["file"].split("/")[1] for c in m2["leaves"]["frozen"]["chunks"]} == {step_dir(1)}  # reused
        assert {c.get("encoding", "raw") for c in m2["leaves"]["zeros"]["chunks"]} == {"shuffle-zstd"}
        pattern = s1["frozen"].numpy().tobytes()[8000:8064]
        for step in (1, 2):
            for path in _data_files(plain, step):
                stored = plain.read_bytes(path)
                assert stored.startswith(MAGIC)
                assert MARKER not in stored and pattern not in stored, path
        for step, state in ((1, s1), (2, s2)):
            target = _target(state)
            assert mgr.restore(target, step=step) == step
            assert_same_state(target, state)
        part = _target(s2)
        mgr.restore(part, step=2, only=["w"])
        assert torch.equal(part["w"], s2["w"]) and (part["frozen"] == 3).all()
        stats = mgr.last_restore_stats
        assert stats is not None and stats.bytes_read < 1_000_000  # not the 2.4 MB tensor
    keyed = EncryptedStorage(storage_root.open(), _keys()).authenticated()
    assert verify_root(plain).ok  # what the CLI does: structure, without the key
    for step in (1, 2):
        full = verify_step(keyed, step)
        assert full.ok and full.bytes_checked > 0, full.to_json()
        keyless = verify_step(plain, step)
        assert keyless.ok and keyless.files_checked >= 1, keyless.to_json()
        assert keyless.structure_only and not full.structure_only and keyless.bytes_checked == 0


class _Counting:
    """A real local store that counts the stored bytes read from data files."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.data_bytes = inner, 0

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.data_bytes += len(buffer) if "/data/" in path else 0
        self.inner.read_into(path, offset, buffer)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.data_bytes += length if "/data/" in path else 0
        return bytes(self.inner.read_range(path, offset, length))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def test_ranged_reads_open_only_the_blocks_they_overlap(tmp_path: Path) -> None:
    """A 64-row slice (256 KiB) of a 4 MiB tensor reads its blocks (+ one at each end, tags,
    the header), not the file; reads across block boundaries return the exact bytes."""
    from shardkeeper.core import Fragment

    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))
    with CheckpointManager(tmp_path, encryption=_keys(), async_save=False) as mgr:
        mgr.save(1, {"big": big})
    counting = _Counting(open_storage(str(tmp_path)))
    with CheckpointManager(counting, encryption=_keys()) as mgr:  # type: ignore[arg-type]
        local = torch.zeros(64 * 1024)
        mgr.restore({"big": Fragment(local, (1024, 1024), 500 * 1024)})
        assert torch.equal(local, big[500:564].reshape(-1))
    assert 64 * 4096 < counting.data_bytes <= 64 * 4096 + 2 * BLOCK + 8 * TAG + 4096, counting.data_bytes
    storage = EncryptedStorage(open_storage(str(tmp_path)), _keys())
    (path,) = _data_files(storage, 1)
    raw = big.numpy().tobytes()
    size = storage.size(path)
    for off, n in ((0, 10), (BLOCK - 3, 7), (5 * BLOCK + 11, 3 * BLOCK), (size - 5, 5)):
        got = storage.read_range(path, off, n)
        assert len(got) == n
        if off >= size - len(raw):
            assert got == raw[off - (size - len(raw)) : off - (size - len(raw)) + n]


def test_wrong_key_and_no_key_are_clear_errors(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, encryption=_keys(), async_save=False) as mgr:
        mgr.save(1, state)
    for step in (1, None):
        target = _target(state)
        with CheckpointManager(tmp_path, encryption=_keys(bytes(32))) as other, pytest.raises(EncryptionKeyError) as e:
            other.restore(target, step=step)
        msg = str(e.value)
        assert "wrong key" in msg and _keys().key_id in msg and str(tmp_path) in msg, msg
        assert (target["frozen"] == 3).all()  # nothing was read
    target = _target(state)
    with CheckpointManager(tmp_path) as nokey, pytest.raises(EncryptionKeyError, match="is encrypted") as e:
        nokey.restore(target)
    assert "encryption=" in str(e.value) and (target["w"] == 3).all()


def test_an_encryption_root_with_a_trailing_slash_names_the_same_root(tmp_path: Path) -> None:
    """``encryption_root="/data/run/"`` bound every step to a name the root's own ("/data/run")
    never equals: reopened without it (or with it written without the slash), no step read."""
    root = Path(os.path.realpath(tmp_path)) / "run"
    state = _state()
    with CheckpointManager(root, encryption=_keys(), encryption_root=f"{root}/", async_save=False) as mgr:
        mgr.save(1, state)
    for bound in (None, str(root), f"{root}//"):
        target = _target(state)
        with CheckpointManager(root, encryption=_keys(), encryption_root=bound) as mgr:
            assert mgr.restore(target) == 1, bound
        assert torch.equal(target["w"], state["w"]), bound
    with CheckpointManager(tmp_path / "slash", encryption=_keys(), encryption_root="/", async_save=False) as mgr:
        mgr.save(1, state)
    with CheckpointManager(tmp_path / "slash", encryption=_keys(), encryption_root="//") as mgr:
        assert mgr.restore(_target(state)) == 1
    with pytest.raises(ValueError, match="encryption_root is empty"):
        CheckpointManager(tmp_path / "empty", encryption=_keys(), encryption_root=" ")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _restore_fails(root: Path, exc: type[BaseException], match: str, only: list[str] | None = None) -> str:
    target = _target(_state())
    if only:
        target = {k: target[k] for k in only}
    with CheckpointManager(root, encryption=_keys()) as mgr, pytest.raises(exc, match=match) as e:
        mgr.restore(target, step=1)
    return str(e.value)


def test_tampered_swapped_and_truncated_blocks_are_detected(tmp_path: Path) -> None:
    state = {"frozen": _state()["frozen"]}
    roots = {}
    for name in ("flip", "swap", "cut", "header", "keyless"):
        roots[name] = tmp_path / name
        with CheckpointManager(roots[name], encryption=_keys(), async_save=False) as mgr:
            mgr.save(1, state)
    files = {n: Path(r) / _data_files(open_storage(str(r)), 1)[0] for n, r in roots.items()}
    # each file's header names its root, so its length differs from root to root
    headers = {n: 12 + int.from_bytes(f.read_bytes()[8:12], "little") for n, f in files.items()}
    header = headers["flip"]
    _flip(files["flip"], header + (BLOCK + TAG) + 100)  # one byte of block 1
    msg = _restore_fails(roots["flip"], ChecksumMismatchError, "fails authentication", ["frozen"])
    assert "'frozen'" in msg and "block 1" in msg and "step 1" in msg and files["flip"].name in msg, msg

    data = bytearray(files["swap"].read_bytes())
    header = headers["swap"]
    b1 = slice(header + (BLOCK + TAG), header + 2 * (BLOCK + TAG))
    b2 = slice(header + 2 * (BLOCK + TAG), header + 3 * (BLOCK + TAG))
    data[b1], data[b2] = data[b2], data[b1]  # two whole, valid blocks in each other's place
    files["swap"].write_bytes(bytes(data))
    _restore_fails(roots["swap"], ChecksumMismatchError, "fails authentication", ["frozen"])

    data = files["cut"].read_bytes()
    header = headers["cut"]
    blocks = -(-(len(data) - header) // (BLOCK + TAG))
    files["cut"].write_bytes(data[: header + (blocks - 1) * (BLOCK + TAG)])  # the last block dropped
    _restore_fails(roots["cut"], CorruptCheckpointError, "shorter than", ["frozen"])

    data = bytearray(files["header"].read_bytes())
    header = headers["header"]
    h = json.loads(data[12:header])
    w = bytearray(base64.b64decode(h["wrapped"]))
    w[3] ^= 1
    new = json.dumps({**h, "wrapped": base64.b64encode(bytes(w)).decode()}, separators=(",", ":")).encode()
    assert len(new) == header - 12
    data[12:header] = new
    files["header"].write_bytes(bytes(data))
    _restore_fails(roots["header"], CorruptCheckpointError, "does not unwrap", ["frozen"])

    keyed = EncryptedStorage(open_storage(str(roots["flip"])), _keys()).authenticated()
    assert not verify_step(keyed, 1).ok  # the key finds the flipped byte
    assert verify_step(open_storage(str(roots["flip"])), 1).ok  # without it only structure: fine
    assert not verify_step(open_storage(str(roots["cut"])), 1).ok  # truncation shows without key


def test_a_data_file_whose_header_names_no_root_is_damage(tmp_path: Path) -> None:
    """Every encrypted file is bound to its root (format.md 4.2): a header without ``root`` is
    damage, named, not a file to authenticate without the binding."""
    with CheckpointManager(tmp_path, encryption=_keys(), async_save=False) as mgr:
        mgr.save(1, {"frozen": _state()["frozen"]})
    path = tmp_path / _data_files(open_storage(str(tmp_path)), 1)[0]
    data = path.read_bytes()
    end = 12 + int.from_bytes(data[8:12], "little")
    h = json.loads(data[12:end])
    del h["root"]
    new = json.dumps(h, separators=(",", ":")).encode()
    path.write_bytes(MAGIC + len(new).to_bytes(4, "little") + new + data[end:])
    msg = _restore_fails(tmp_path, CorruptCheckpointError, "names no root it is bound to", ["frozen"])
    assert path.name in msg and "restore another step" in msg, msg


def test_tampered_or_unsealed_manifest_is_refused_before_data_is_read(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, encryption=_keys(), async_save=False) as mgr:
        mgr.save(1, state)
    path = tmp_path / step_dir(1) / "manifest.json"
    sealed = path.read_bytes()
    m = json.loads(sealed)
    shape = json.dumps(m["leaves"]["w"]["shape"], separators=(",", ":")).encode()
    forged = sealed.replace(b'"step":1,', b'"step":1 ,', 1)  # same JSON, other bytes
    path.write_bytes(forged)
    msg = _restore_fails(tmp_path, CorruptCheckpointError, "fails authentication")
    assert str(tmp_path) in msg and "manifest" in msg
    assert shape in sealed
    del m["encryption"]
    path.write_bytes(json.dumps(m, separators=(",", ":")).encode())  # stripped of its MAC
    _restore_fails(tmp_path, CorruptCheckpointError, "not encrypted/authenticated")  # damage: falls back
    path.write_bytes(sealed)
    target = _target(state)
    with CheckpointManager(tmp_path, encryption=_keys()) as mgr:
        assert mgr.restore(target) == 1
    assert_same_state(target, state)


def test_key_providers_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SK_TEST_KEK", base64.b64encode(KEK).decode())
    (tmp_path / "kek").write_bytes(KEK)
    state = {"w": torch.randn(64, 64)}
    with CheckpointManager(tmp_path / "r", encryption="env:SK_TEST_KEK", async_save=False) as mgr:
        mgr.save(1, state)
    target = {"w": torch.zeros(64, 64)}
    with CheckpointManager(tmp_path / "r", encryption=f"file:{tmp_path / 'kek'}") as mgr:
        mgr.restore(target)
    assert torch.equal(target["w"], state["w"])
    monkeypatch.setenv("SK_TEST_KEK", base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="5 bytes, an AES-256 key is 32"):
        CheckpointManager(tmp_path / "r", encryption="env:SK_TEST_KEK")
    with pytest.raises(ValueError, match="is not set"):
        CheckpointManager(tmp_path / "r", encryption="env:SK_NO_SUCH_VAR")
    with pytest.raises(ValueError, match="'env:VAR', 'file:PATH'"):
        CheckpointManager(tmp_path / "r", encryption="kms")


class _ToyKms:
    """A KeyProvider as a KMS would implement it: several key ids (rotation), wraps with
    the newest; here the 'KMS' is AES-GCM under per-id keys held in this object."""

    def __init__(self, keys: dict[str, bytes], current: str) -> None:
        self.keys, self.key_id, self.calls = keys, current, 0

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.calls += 1
        nonce = os.urandom(12)
        return self.key_id, nonce + AESGCM(self.keys[self.key_id]).encrypt(nonce, data_key, None)

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.calls += 1
        if key_id not in self.keys:
            raise EncryptionKeyError(f"the KMS has no key {key_id}")
        return AESGCM(self.keys[key_id]).decrypt(wrapped[:12], wrapped[12:], None)


def test_a_kms_style_provider_with_key_rotation(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 300)}
    old = _ToyKms({"k1": bytes(32)}, "k1")
    with CheckpointManager(tmp_path, encryption=old, async_save=False) as mgr:
        mgr.save(1, state)
    assert old.calls == 2  # one data file + one manifest MAC key
    rotated = _ToyKms({"k1": bytes(32), "k2": bytes(range(32))}, "k2")
    with CheckpointManager(tmp_path, encryption=rotated, async_save=False) as mgr:
        mgr.save(2, {"w": state["w"] + 1})
        for step, want in ((1, state["w"]), (2, state["w"] + 1)):
            target = {"w": torch.zeros(300, 300)}
            mgr.restore(target, step=step)
            assert torch.equal(target["w"], want)
    assert json.loads((tmp_path / step_dir(2) / "manifest.json").read_bytes())["encryption"]["key_id"] == "k2"
    with (
        CheckpointManager(tmp_path, encryption=_ToyKms({"k2": bytes(range(32))}, "k2")) as mgr,
        pytest.raises(EncryptionKeyError, match="no key k1"),
    ):
        mgr.restore({"w": torch.zeros(300, 300)}, step=1)


def test_export_decrypts_with_the_key_and_refuses_without(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardkeeper.core.tools.export import export_safetensors

    w = torch.randn(128, 64)
    with CheckpointManager(tmp_path / "r", encryption=_keys(), async_save=False, incremental=True) as mgr:
        mgr.save(1, {"model": {"w": w}})
        mgr.save(2, {"model": {"w": w}})  # a reference to step 1's file
        assert mgr.manifest(2).leaves["model/w"].chunks[0].file.startswith("../")
    res = export_safetensors(tmp_path / "r", 2, to=tmp_path / "hf", encryption=_keys())
    (name,) = set(res.weight_map.values())
    assert torch.equal(load_file(str(tmp_path / "hf" / name))["w"], w)
    with pytest.raises(EncryptionKeyError, match="is encrypted"):
        export_safetensors(tmp_path / "r", to=tmp_path / "hf2")


def test_cli_verify_and_export_take_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardkeeper verify/export --key env:VAR`: with the key, blocks are authenticated (a
    flipped ciphertext byte is damage) and export decrypts; without it export refuses."""
    from safetensors.torch import load_file

    from shardkeeper.core.cli import main

    monkeypatch.setenv("SK_TEST_KEK", base64.b64encode(KEK).decode())
    w = torch.randn(256, 64)
    root = tmp_path / "r"
    with CheckpointManager(root, encryption="env:SK_TEST_KEK", async_save=False) as mgr:
        mgr.save(3, {"model": {"w": w}})
    assert main(["verify", str(root), "--key", "env:SK_TEST_KEK"]) == 0
    assert main(["export", str(root), "--to", str(tmp_path / "hf"), "--key", "env:SK_TEST_KEK"]) == 0
    (f,) = (tmp_path / "hf").glob("*.safetensors")
    assert torch.equal(load_file(str(f))["w"], w)
    assert main(["export", str(root), "--to", str(tmp_path / "hf2")]) != 0
    assert "is encrypted" in capsys.readouterr().err
    assert main(["verify", str(root), "--key", "kms"]) == 2  # a usage error, named
    assert "bad --key 'kms'" in capsys.readouterr().err
    (data,) = (root / step_dir(3) / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root), "--key", "env:SK_TEST_KEK"]) == 1
    capsys.readouterr()
    assert main(["verify", str(root)]) == 0  # without the key: the structure only, and said so
    out = capsys.readouterr().out
    assert "structure OK" in out and "no byte was checked: pass --key" in out and ": OK (" not in out


def test_missing_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ImportError, match=r"shardkeeper-core\[crypto\]"):
        CheckpointManager(tmp_path, encryption=_keys())
    assert os.listdir(tmp_path) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_encrypted_async_incremental_compressed_resharded_2_to_3(tmp_path: Path) -> None:
    """One torchrun launch of dist/codecs_worker.py with encryption on: FSDP2 + DTensors saved
    at 2 ranks (async, incremental, zstd), restored at 3 ranks whole and partially, bit for
    bit; a wrong key fails on every rank."""
    from .._launch import run_codecs_worker

    checks = run_codecs_worker(
        tmp_path, [{"name": "local", "url": str(tmp_path / "root"), "options": {}, "mode": "encrypted"}]
    )
    assert len(checks) == 2 + 3 * 4, [c["name"] for c in checks]
    plain = open_storage(str(tmp_path / "root"))
    assert json.loads(plain.read_bytes(f"{step_dir(2)}/manifest.json"))["encryption"]
    for step in (1, 2):
        for path in _data_files(plain, step):
            assert plain.read_range(path, 0, 8) == MAGIC


def test_torn_write_is_replayed_by_the_retrying_writer(tmp_path: Path) -> None:
    """A transient fault in the middle of an encrypted shard upload: the retry layer (below
    the encryption) replays the ciphertext it was given; the step restores bit for bit."""
    from shardkeeper.core.storage.local import LocalStorage
    from shardkeeper.core.testing.faults import FaultyStorage

    faulty = FaultyStorage(
        LocalStorage(tmp_path), fail_on={"write": "*/data/*"}, after_bytes=3 << 20, times=1, error=ConnectionResetError
    )
    state = {"a": torch.randn(1024, 2048), "b": torch.arange(100_000)}
    with CheckpointManager(faulty, encryption=_keys(), retry_base_delay_s=0.01) as mgr:  # type: ignore[arg-type]
        mgr.save(1, state)
        mgr.wait()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, encryption=_keys()) as mgr:
        mgr.restore(target)
    assert_same_state(target, state)


def test_files_swapped_between_paths_and_a_chunk_table_manifest(tmp_path: Path) -> None:
    """Two files of one step exchanged (each intact) fail: the path is in every block's
    associated data. A manifest in the columnar chunk table (>= 4096 chunks) is sealed and
    restores like any other."""
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(4200)}
    state["big1"] = torch.randn(512, 512)
    state["big2"] = torch.randn(512, 512)
    with CheckpointManager(tmp_path, encryption=_keys(), async_save=False, min_file_bytes=1 << 18) as mgr:
        mgr.save(1, state)
        m = json.loads((tmp_path / step_dir(1) / "manifest.json").read_bytes())
        assert "chunk_table" in m and m["encryption"]
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(target)
        assert_same_state(target, state)
    a, b = (tmp_path / p for p in _data_files(open_storage(str(tmp_path)), 1)[:2])
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    with CheckpointManager(tmp_path, encryption=_keys()) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore({k: torch.zeros_like(v) for k, v in state.items()}, step=1)
