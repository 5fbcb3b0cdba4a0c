"""Restores that fail or fall back never report success over a wrong target, nor leave a mix.

- A fallback after a damaged step rewrites every key the failed attempt wrote (bit for bit
  the older step's), or refuses, naming the keys, when the older step lacks some of them; a
  key the failed attempt never wrote keeps the target's own value.
- Bytes that fail their digest or their authentication tag never stay in the target.
- A failed restore whose reads wrote into the target says that it is partly restored; objects,
  bytes and ``load_state_dict`` get nothing from a failed attempt.
- A target on the meta device is refused before any read.
- Another kind of optimizer's state (AdamW's into SGD, Adam's into AdamW) is refused before any
  read; the same optimizer saved with fewer or more hyper-parameters (another torch) restores.

Real models and optimizers, real saves under tmp roots, real damage (a flipped byte in a
data file at a known chunk).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkeeper.core import (
    CheckpointManager,
    CheckpointRestoreError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StateMismatchError,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from tests.checks import assert_same_state

pytestmark = pytest.mark.timeout(300)

PARTLY = "partly restored"
REMEDY = "do not train from it; restore again or rebuild it"


def _mlp(seed: int) -> nn.Module:
    """``0.weight`` is 1 MiB (read straight into the target), the rest is small (buffered)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 512, generator=g), torch.randn(4, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


Snapshot = tuple[dict[str, torch.Tensor], dict[str, Any]]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())


def _assert_state(model: nn.Module, opt: torch.optim.Optimizer, snap: Snapshot) -> None:
    """Every parameter and every optimizer state tensor bit for bit, and the param groups."""
    assert_same_state({"model": model.state_dict(), "optim": opt.state_dict()}, {"model": snap[0], "optim": snap[1]})


def _chunk(root: Path, step: int, key: str) -> tuple[Path, dict[str, Any]]:
    c = json.loads((root / step_dir(step) / "manifest.json").read_bytes())["leaves"][key]["chunks"][0]
    return root / step_dir(step) / c["file"], c


def _flip(root: Path, step: int, key: str) -> int:
    """Flip one byte in the middle of ``key``'s chunk in ``step``'s data file; its chunk offset."""
    path, c = _chunk(root, step, key)
    at = c["length"] // 2
    raw = bytearray(path.read_bytes())
    raw[c["offset"] + at] ^= 0x40
    path.write_bytes(bytes(raw))
    return at


def _two_steps(root: Path, **opts: Any) -> tuple[Any, Any, nn.Module, torch.optim.Optimizer]:
    """Steps 1 and 2 of an MLP trained with AdamW; the snapshots of both."""
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, async_save=False, **opts) as mgr:
        _train(model, opt, 2, seed=1)
        mgr.save(1, {"model": model, "optim": opt})
        snap1 = _snapshot(model, opt)
        _train(model, opt, 2, seed=2)
        mgr.save(2, {"model": model, "optim": opt})
        snap2 = _snapshot(model, opt)
    return snap1, snap2, model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _mlp(7)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class _CountingStorage(LocalStorage):
    """A local root that counts the reads of data files (what restore read, not a fault)."""

    data_reads = 0

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        if "/data/" in path:
            type(self).data_reads += 1
        super().read_into(path, offset, buffer)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if "/data/" in path:
            type(self).data_reads += 1
        return super().read_range(path, offset, length)


# ------------------------------------------------------------------ fallback: no mix of two steps


def test_fallback_restores_every_value_of_the_older_step(tmp_path: Path) -> None:
    """The common case: both steps hold the same keys, the damaged one's attempt wrote some of
    them; the fallback rewrites all of them, bit for bit, with no refusal."""
    snap1, snap2, _, _ = _two_steps(tmp_path)
    _flip(tmp_path, 2, "model/2.weight")  # small: read after the 1 MiB tensors have landed
    model, opt = _fresh()
    with CheckpointManager(tmp_path, io_threads=1) as mgr:
        with pytest.warns(UserWarning, match=r"step 2 .*damaged.*falling back"):
            assert mgr.restore({"model": model, "optim": opt}) == 1
    _assert_state(model, opt, snap1)
    assert not torch.equal(snap1[0]["0.weight"], snap2[0]["0.weight"])  # step 2's was written first
    _train(model, opt, 1, seed=3)  # and it trains


def test_fallback_refuses_when_the_older_step_lacks_a_key_the_failed_attempt_wrote(tmp_path: Path) -> None:
    """strict=False: step 2 holds ``ema``, step 1 does not. Step 2's attempt wrote ``ema``
    (read first, intact) before it failed: falling back would leave step 2's ``ema`` next to
    step 1's model. Refused, naming the key, the steps and the remedy; the remedy works."""
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = torch.randn(600, 512)  # larger than any other tensor: the first read
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        _train(model, opt, 2, seed=1)
        mgr.save(1, {"model": model, "optim": opt})
        snap1 = _snapshot(model, opt)
        _train(model, opt, 1, seed=2)
        mgr.save(2, {"model": model, "optim": opt, "ema": ema})
    _flip(tmp_path, 2, "model/2.bias")  # read after ema, with io_threads=1
    m2, o2 = _fresh()
    target = {"model": m2, "optim": o2, "ema": torch.full((600, 512), 3.0)}
    with CheckpointManager(tmp_path, io_threads=1) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointRestoreError) as e:
                mgr.restore(target, strict=False)
        msg = str(e.value)
        assert "ema" in msg and "step(s) 2" in msg and "nothing of step 1 was read" in msg, msg
        assert "restore(state, step=1" in msg and PARTLY in msg and REMEDY in msg, msg
        assert str(tmp_path) in msg and "rank 0" in msg, msg
        # The remedy: a rebuilt state, step 1 asked for explicitly.
        m3, o3 = _fresh()
        fresh_ema = torch.full((600, 512), 3.0)
        with pytest.warns(UserWarning, match="keep their current values: ema"):
            assert mgr.restore({"model": m3, "optim": o3, "ema": fresh_ema}, step=1, strict=False) == 1
    _assert_state(m3, o3, snap1)
    assert torch.equal(fresh_ema, torch.full((600, 512), 3.0))


def test_fallback_keeps_the_target_value_of_a_key_the_failed_attempt_did_not_write(tmp_path: Path) -> None:
    """strict=False: the damage is in the first read, so step 2's attempt stops before it
    writes ``ema``; step 1 (which lacks ``ema``) is restored, and ``ema`` keeps the target's
    own value, bit for bit."""
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        _train(model, opt, 2, seed=1)
        mgr.save(1, {"model": model, "optim": opt})
        snap1 = _snapshot(model, opt)
        _train(model, opt, 1, seed=2)
        mgr.save(2, {"model": model, "optim": opt, "ema": torch.randn(4, 8)})
    _flip(tmp_path, 2, "model/0.weight")  # the first of the 1 MiB reads
    m2, o2 = _fresh()
    own = torch.randn(4, 8)
    target = {"model": m2, "optim": o2, "ema": own.clone()}
    with CheckpointManager(tmp_path, io_threads=1) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mgr.restore(target, strict=False) == 1
    texts = [str(w.message) for w in caught]
    assert any("falling back" in t for t in texts) and any("keep their current values: ema" in t for t in texts)
    _assert_state(m2, o2, snap1)
    assert torch.equal(target["ema"], own)


# ------------------------------------------------------------------ no unverified bytes in the target


def test_bytes_that_fail_their_digest_do_not_stay_in_the_target(tmp_path: Path) -> None:
    """A 2 MiB tensor is read straight into the target and verified there: after the checksum
    mismatch, no element holds a byte of step 2 (only the target's own value or zero)."""
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.randn(512, 1024)})
        mgr.save(2, {"w": torch.randn(512, 1024)})
    _flip(tmp_path, 2, "w")
    target = {"w": torch.full((512, 1024), 7.0)}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ChecksumMismatchError) as e:
        mgr.restore(target, step=2)
    t = target["w"]
    assert bool(((t == 7.0) | (t == 0)).all()), "bytes of the damaged step stayed in the target"
    assert e.value.key == "w" and "step 2" in str(e.value) and PARTLY in str(e.value) and REMEDY in str(e.value)


def test_bytes_that_fail_authentication_do_not_stay_in_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encrypted: one ciphertext byte of block k flipped. Neither the restore target nor the
    buffer of a plain ranged read keeps the block's decrypted, unauthenticated plaintext."""
    pytest.importorskip("cryptography")
    from shardkeeper.core.codec.crypto import EncryptedStorage
    from shardkeeper.core.codec.crypto_format import BLOCK, TAG
    from shardkeeper.core.codec.keys import key_provider
    from shardkeeper.core.storage import open_storage

    monkeypatch.setenv("SK_RESTORE_KEK", base64.b64encode(os.urandom(32)).decode())
    w2 = torch.randn(512, 1024)
    with CheckpointManager(tmp_path, encryption="env:SK_RESTORE_KEK", async_save=False) as mgr:
        mgr.save(1, {"w": torch.randn(512, 1024)})
        mgr.save(2, {"w": w2})
    path, c = _chunk(tmp_path, 2, "w")
    raw = bytearray(path.read_bytes())
    header = 12 + int.from_bytes(raw[8:12], "little")
    plain = c["offset"] + c["length"] // 2
    k = plain // BLOCK
    raw[header + k * (BLOCK + TAG) + plain % BLOCK] ^= 0x01
    path.write_bytes(bytes(raw))

    target = {"w": torch.full((512, 1024), 7.0)}
    with CheckpointManager(tmp_path, encryption="env:SK_RESTORE_KEK") as mgr:
        with pytest.raises(ChecksumMismatchError, match="fails authentication") as e:
            mgr.restore(target, step=2)
    t = target["w"]
    assert bool(((t == 7.0) | (t == 0)).all()), "unauthenticated plaintext stayed in the target"
    assert PARTLY in str(e.value)

    # The storage layer itself: a ranged read of the chunk into a caller's buffer.
    storage = EncryptedStorage(open_storage(str(tmp_path)), key_provider("env:SK_RESTORE_KEK"))
    rel = str(path.relative_to(tmp_path))
    buf = bytearray(b"\xab" * c["length"])
    with pytest.raises(ChecksumMismatchError, match=f"encrypted block {k} "):
        storage.read_into(rel, c["offset"], memoryview(buf))
    lo = k * BLOCK - c["offset"]  # block k within the buffer
    assert lo > 0
    want = w2.view(-1).view(torch.uint8).numpy().tobytes()
    assert buf[:lo] == want[:lo]  # the blocks before k: authenticated plaintext
    assert buf[lo : lo + BLOCK] == bytes(BLOCK), "block k's unauthenticated plaintext is in the buffer"


# ------------------------------------------------------------------ "partly restored", objects, finalizers


def test_a_failed_restore_says_partly_restored_only_when_reads_wrote(tmp_path: Path) -> None:
    root, gone = tmp_path / "root", tmp_path / "gone"
    _two_steps(root)
    # (1) Step 2's file is gone: found before any read, the target is untouched.
    _two_steps(gone)
    _chunk(gone, 2, "model/0.weight")[0].unlink()
    model, opt = _fresh()
    _train(model, opt, 1, seed=5)  # its own state (a fresh one gets zeros when flattened)
    before = _snapshot(model, opt)
    with CheckpointManager(gone) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore({"model": model, "optim": opt}, step=2)
    assert "missing or shorter" in str(e.value) and PARTLY not in str(e.value)
    _assert_state(model, opt, before)

    # (2) A checksum mismatch in a read after others landed: the error keeps its type and
    # attributes and says the target is partly restored.
    _flip(root, 2, "model/2.bias")
    model, opt = _fresh()
    with CheckpointManager(root, io_threads=1) as mgr:
        with pytest.raises(ChecksumMismatchError) as e:
            mgr.restore({"model": model, "optim": opt}, step=2)
        msg = str(e.value)
        assert e.value.key == "model/2.bias" and "step 2" in msg and str(root) in msg, msg
        assert PARTLY in msg and REMEDY in msg and "'model/0.weight'" in msg, msg

        # (3) Every step damaged: the final error says it too.
        _flip(root, 1, "model/2.bias")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointRestoreError, match="could be restored") as e:
                mgr.restore({"model": model, "optim": opt})
        assert PARTLY in str(e.value) and REMEDY in str(e.value) and "step(s) 2, 1" in str(e.value)


class _Counter:
    """A stateful object: records what ``load_state_dict`` is handed."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.table = torch.full((3, 5), float(n))
        self.loaded: list[tuple[int, torch.Tensor]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "table": self.table.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append((sd["n"], sd["table"].clone()))
        self.n, self.table = sd["n"], sd["table"]


def test_a_failed_attempt_sets_no_object_or_bytes_and_calls_no_load_state_dict(tmp_path: Path) -> None:
    model = _mlp(0)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": model, "counter": _Counter(1), "blob": b"one" * 100, "meta": {"seed": 1}})
        snap1 = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, seed=2)
        mgr.save(2, {"model": model, "counter": _Counter(2), "blob": b"two" * 100, "meta": {"seed": 2}})
    _flip(tmp_path, 2, "model/0.weight")

    counter, m2 = _Counter(0), _mlp(7)
    target = {"model": m2, "counter": counter, "blob": b"", "meta": {"seed": -1}}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ChecksumMismatchError):
            mgr.restore(target, step=2)
        assert counter.loaded == [] and counter.n == 0
        assert target["blob"] == b"" and target["meta"] == {"seed": -1}

        with pytest.warns(UserWarning, match="falling back"):
            assert mgr.restore(target) == 1
    assert [n for n, _ in counter.loaded] == [1] and torch.equal(counter.loaded[0][1], torch.full((3, 5), 1.0))
    assert target["blob"] == b"one" * 100 and target["meta"] == {"seed": 1}
    assert_same_state(m2.state_dict(), snap1, what="the model after the fallback")


# ------------------------------------------------------------------ meta device


def test_restore_into_a_model_on_the_meta_device_is_refused_before_any_read(tmp_path: Path) -> None:
    snap1, _, _, _ = _two_steps(tmp_path)
    with torch.device("meta"):
        model = _mlp(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    storage = _CountingStorage(str(tmp_path))
    _CountingStorage.data_reads = 0
    with CheckpointManager(storage) as mgr:
        with pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": model, "optim": opt}, step=1)
        msg = str(e.value)
        assert "meta device" in msg and "model/0.weight" in msg and "model/2.bias" in msg, msg
        assert "model.to_empty(device=...)" in msg and "step 1" in msg and str(tmp_path) in msg, msg
        assert _CountingStorage.data_reads == 0
        assert PARTLY not in msg
        # The remedy.
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert mgr.restore({"model": model, "optim": opt}) == 2
        assert _CountingStorage.data_reads > 0
        assert mgr.restore({"model": model, "optim": opt}, step=1) == 1
    _assert_state(model, opt, snap1)


# ------------------------------------------------------------------ another kind of optimizer


def _adamw_root(root: Path, *, metadata: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": model, "optim": opt}, metadata=metadata)
    return model, _snapshot(model, opt)


@pytest.mark.parametrize("recorded", [True, False], ids=["class-recorded", "class-not-recorded"])
def test_an_adamw_checkpoint_into_sgd_is_refused(tmp_path: Path, recorded: bool) -> None:
    """Without the check, SGD silently got AdamW's param groups and failed at its first step()
    with KeyError: 'momentum'. A checkpoint without the class record (another writer) is
    told apart by its hyper-parameter names."""
    _, (params, _) = _adamw_root(tmp_path, metadata=None if recorded else {"optimizer_classes": None})
    for momentum, strict in ((0.9, True), (0.9, False), (0.0, False)):
        model = _mlp(7)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups]
        with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": model, "optim": sgd}, strict=strict)
        msg = str(e.value)
        assert "'optim'" in msg and "SGD" in msg and "momentum" in msg and "betas" in msg, msg
        assert ("AdamW" in msg) == recorded and ("not recorded" in msg) != recorded, msg
        assert "only=['model/*']" in msg and "step 1" in msg and str(tmp_path) in msg, msg
        if momentum:  # SGD with momentum has state: its names differ too
            assert "exp_avg" in msg and "momentum_buffer" in msg, msg
        assert_same_state(model.state_dict(), before, what="the model (nothing may be read)")
        assert [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups] == groups
    # The remedy: the model alone; SGD then trains.
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": model, "optim": sgd}, only=["model/*"]) == 1
    assert_same_state(model.state_dict(), params, what="the model restored alone")
    _train(model, sgd, 1, seed=3)


def test_an_adam_checkpoint_into_adamw_is_refused(tmp_path: Path) -> None:
    """Adam and AdamW have the same hyper-parameter and state names; the recorded class tells
    them apart (restored, AdamW would train on with Adam's weight decay)."""
    model = _mlp(0)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, adam, 1, seed=1)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": model, "optim": adam})
    m2 = _mlp(7)
    adamw = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": m2, "optim": adamw})
        assert mgr.manifest(1).metadata["optimizer_classes"] == {"optim": "torch.optim.adam.Adam"}
    msg = str(e.value)
    assert "torch.optim.adam.Adam" in msg and "torch.optim.adamw.AdamW" in msg and "(Adam)" in msg, msg


@pytest.mark.parametrize("recorded", [True, False], ids=["class-recorded", "class-not-recorded"])
def test_the_same_optimizer_saved_by_another_torch_version_restores(tmp_path: Path, recorded: bool) -> None:
    """Version skew of one optimizer class: a group saved without hyper-parameters a newer torch
    added (the optimizer's __setstate__ fills them), or with one this torch does not know."""
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    meta = None if recorded else {"optimizer_classes": None}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for g in opt.param_groups:  # as an older torch wrote them
            del g["decoupled_weight_decay"], g["fused"]
        mgr.save(1, {"model": model, "optim": opt}, metadata=meta)
        older = _snapshot(model, opt)
        for g in opt.param_groups:  # as a newer torch would
            g.update(decoupled_weight_decay=True, fused=None, future_knob=0.5)
        mgr.save(2, {"model": model, "optim": opt}, metadata=meta)
        newer = _snapshot(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        m2, o2 = _fresh()
        assert mgr.restore({"model": m2, "optim": o2}, step=1) == 1
        params, osd = older
        filled = [{**g, "decoupled_weight_decay": True, "fused": None} for g in osd["param_groups"]]
        _assert_state(m2, o2, (params, {**osd, "param_groups": filled}))  # defaults filled by torch
        _train(m2, o2, 1, seed=3)
        m3, o3 = _fresh()
        assert mgr.restore({"model": m3, "optim": o3}, step=2) == 2
        _assert_state(m3, o3, newer)
        _train(m3, o3, 1, seed=3)


@pytest.mark.parametrize("optional", [None, ["optim/*"]], ids=["plain", "optional"])
def test_another_number_of_param_groups_is_refused_before_reading(tmp_path: Path, optional: Any) -> None:
    """One param group saved, two in the target (the Hugging Face Trainer's split by weight
    decay): the saved groups landed on the target's one by one, and with ``optional=`` the
    second group was left without lr/betas (AdamW then failed at its first step with
    KeyError: 'betas'). Refused before anything is read, either way; the model alone restores."""
    _, (params, _) = _adamw_root(tmp_path)
    model = _mlp(7)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named[:1]]}, {"params": [p for _, p in named[1:]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError) as e:
        mgr.restore({"model": model, "optim": opt}, optional=optional)
    msg = str(e.value)
    assert "'optim'" in msg and "1 param group(s), the target has 2" in msg and "nothing was read" in msg, msg
    assert "only=['model/*']" in msg and "step 1" in msg and str(tmp_path) in msg, msg
    assert_same_state(model.state_dict(), before, what="the model (nothing may be read)")
    assert all({"lr", "betas", "eps"} <= set(g) for g in opt.param_groups)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": model, "optim": opt}, only=["model/*"]) == 1
    assert_same_state(model.state_dict(), params, what="the model restored alone")
    _train(model, opt, 1, seed=3)


class _Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``): ``state_dict()`` lists it under both names."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.wte.weight


def test_a_tied_weight_saved_under_one_name_restores_strictly_into_both(tmp_path: Path) -> None:
    """A save that walks named_parameters() (DeepSpeed's engine state) holds a tied weight once;
    a strict restore into the module fills the alias through its twin. A key that is no alias
    is still missing."""
    src = _Tied()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": dict(src.named_parameters())}).wait()  # wte.weight only
        assert "model/head.weight" not in mgr.manifest(1).leaves
        dst = _Tied()
        with torch.no_grad():
            dst.wte.weight.zero_()
        assert mgr.restore({"model": dst}) == 1
        assert torch.equal(dst.head.weight, src.wte.weight) and dst.head.weight is dst.wte.weight
        untied = _Tied()
        untied.head.weight = torch.nn.Parameter(torch.zeros(6, 4))  # its own memory: no alias
        with pytest.raises(StateMismatchError, match=r"model/head\.weight"):
            mgr.restore({"model": untied})


def test_only_per_rank_state_dropped_at_another_world_size_is_no_unmatched_only(tmp_path: Path) -> None:
    """restore(only="rng/*", per_rank="drop") at another world size than the save's drops every
    RNG key it matched: that is a restore of nothing to do, not an ``only=`` that matches no key
    (the Trainer adapter restores its RNG alone, at its own point of the start-up)."""
    from shardkeeper.core import RNGState
    from shardkeeper.core.restore.plan import plan_restore
    from shardkeeper.core.state.flatten import flatten_for_restore

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2), "rng": RNGState()}).wait()
        manifest, storage = mgr.manifest(1), mgr.storage
    flat = flatten_for_restore({"w": torch.zeros(2), "rng": RNGState()}, 1, strict=True)
    args = {"rank": 1, "world_size": 2, "only": ["rng/*"], "strict": True, "optional": None, "cast": False}
    plan = plan_restore(storage, manifest, flat, per_rank="drop", max_read_bytes=1 << 20, where="step 1", **args)
    assert plan.dropped and not plan.restored and not plan.missing
    with pytest.raises(StateMismatchError, match="saved at world size 1, restoring at 2"):
        plan_restore(storage, manifest, flat, per_rank="exact", max_read_bytes=1 << 20, where="step 1", **args)


class _Refusing:
    """An object whose ``load_state_dict`` refuses what it is given, as a changed scheduler's
    does (``KeyError``: its ``__str__`` is the key's repr) or torch's size checks do
    (``RuntimeError`` with a message)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def state_dict(self) -> dict[str, Any]:
        return {"n": 3}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("size mismatch for w"), KeyError("lr_lambdas")])
def test_an_objects_refusal_names_the_checkpoint_the_key_and_the_remedy_and_keeps_its_type(
    tmp_path: Path, error: Exception
) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "sched": _Refusing(RuntimeError("unused"))})
        mgr.save(2, {"w": torch.ones(3), "sched": _Refusing(RuntimeError("unused"))})
        with pytest.raises(type(error)) as got:
            mgr.restore({"w": torch.zeros(3), "sched": _Refusing(error)})
    said = "\n".join([str(got.value), *getattr(got.value, "__notes__", [])])
    assert str(error).strip("'") in said, said  # the object's own words
    for part in (str(tmp_path), "step-000000000002", "rank 0", "'sched'", "load_state_dict()", "mgr.load()"):
        assert part in said, (part, said)
