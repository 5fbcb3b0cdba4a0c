"""A damaged newest step under an auto-restarted loop (``start = mgr.restore(state) + 1``).

The restore falls back to the previous step, and the loop then saves the damaged step's
number again. Before, that save was refused (the damaged step was still committed) on every
restart until someone ran ``shardkeeper delete ROOT N --damaged``. Now the restore that found
the damage verifies it and quarantines the step (its manifest moved aside, its files kept
until gc), so that save commits; damage that is not proven on the stored bytes (a fault in
transit, a storage error, a key the provider does not hold) quarantines nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.claim import claim_path
from shardkeeper.core.commit.committed import committed_steps, manifest_path
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.lifecycle.gc import collect_garbage
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.faults import FaultyStorage
from tests.checks import assert_same_state
from tests.core._builders import run_cli

from .._launch import run_workers

pytestmark = pytest.mark.timeout(120)

QUARANTINED = r"step 4 under .* is damaged \((?P<found>.*)\) and was quarantined"


def _state(step: int, run: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1000 * run)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(32, generator=g)}


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code, out, err = run_cli(capsys, *argv)
    return code, out + err


def _blank() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(64, 64), "b": torch.zeros(32)}


def _loop(root: Any, end: int, run: int, **opts: Any) -> int:
    """A training loop as an auto-restarted job runs it: resume, then save each step to ``end``."""
    with CheckpointManager(root, **opts) as mgr:
        state = _blank()
        try:
            start = mgr.restore(state) + 1
        except FileNotFoundError:
            start = 1
        for step in range(start, end + 1):
            mgr.save(step, _state(step, run)).wait()
    return start


def _damage(root: Path, step: int, how: str) -> str:
    """Damage ``step``'s data file of key ``a`` on disk; its root-relative path."""
    c = json.loads((root / manifest_path(step)).read_bytes())["leaves"]["a"]["chunks"][0]
    path = root / step_dir(step) / c["file"]
    if how == "missing":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw[c["offset"] + c["length"] // 2] ^= 0x20
        path.write_bytes(bytes(raw))
    return f"{step_dir(step)}/{c['file']}"


@pytest.mark.parametrize("how", ["flipped", "missing"])
def test_a_restarted_loop_saves_again_past_a_damaged_newest_step(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _loop(tmp_path, 4, run=0)
    damaged = _damage(tmp_path, 4, how)
    with pytest.warns(UserWarning, match=QUARANTINED) as caught:
        assert _loop(tmp_path, 5, run=1) == 4  # resumed from step 3, saved steps 4 and 5
    msg = next(str(w.message) for w in caught if "quarantined" in str(w.message))
    assert ("digest mismatch" if how == "flipped" else "is missing") in msg and damaged in msg, msg
    (aside,) = (tmp_path / step_dir(4)).glob("quarantined-*.manifest.json")
    assert str(aside) in msg and "until `shardkeeper gc` removes them" in msg, msg
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2, 3, 4, 5]
    with CheckpointManager(tmp_path) as mgr:
        for step in (4, 5):
            got = _blank()
            assert mgr.restore(got, step=step) == step
            assert_same_state(got, _state(step, run=1), what=f"the new step {step}")
    assert aside.exists() and (how == "missing" or (tmp_path / damaged).exists()), "kept until gc"
    report = collect_garbage(LocalStorage(tmp_path), min_age_s=0)
    assert not aside.exists() and not (tmp_path / damaged).exists(), report
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 0, out


def test_the_cli_shows_a_quarantined_step_until_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _loop(tmp_path, 4, run=0)
    damaged = _damage(tmp_path, 4, "flipped")
    with CheckpointManager(tmp_path) as mgr, pytest.warns(UserWarning, match=QUARANTINED):
        assert mgr.restore(_blank()) == 3
    code, out, _ = run_cli(capsys, "ls", str(tmp_path), "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)["steps"]][-1] == "quarantined", out
    code, out = _cli(capsys, "verify", str(tmp_path), "4")
    assert code == 2 and "quarantined it" in out and "--quarantined" in out, out
    code, out = _cli(capsys, "verify", str(tmp_path), "4", "--quarantined")
    assert code == 1 and "digest mismatch" in out and damaged.rsplit("/", 1)[-1] in out, out
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path), "4", "--quarantined", "--json")
    assert code == 0 and json.loads(out)["step"] == 4, out
    code, out = _cli(capsys, "verify", str(tmp_path))  # the committed steps: all clean
    assert code == 0, out
    gone = collect_garbage(LocalStorage(tmp_path))  # the default age rule: kept for a look
    assert not gone.removed_paths and (tmp_path / damaged).exists(), gone


class _OnTheWire(FaultyStorage):
    """Reads of step 4's data files come back with a byte flipped (a fault in transit: no
    server makes one on request) until one has; after that they pass (``recovers``) or fail
    with an I/O error (``fails``: the storage fails, as a transient outage does)."""

    def __init__(self, root: Path, then: str) -> None:
        self.pattern = f"{step_dir(4)}/data/*"
        super().__init__(LocalStorage(root), corrupt=self.pattern)
        self.then = then

    def _turn(self) -> None:
        if self.injected and self.corrupt:
            self.corrupt = ()
            if self.then == "fails":
                self.fail_on = {op: (self.pattern,) for op in ("read_range", "read_into", "read_bytes")}

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        try:
            return super().read_range(path, offset, length)
        finally:
            self._turn()

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        try:
            super().read_into(path, offset, buffer)
        finally:
            self._turn()


def _not_quarantined(root: Path, storage: Any, why: str, **opts: Any) -> None:
    """The restore falls back (as before) but quarantines nothing, and says why."""
    with CheckpointManager(storage, **opts) as mgr:
        with pytest.warns(UserWarning, match=rf"step 4 under .* was not quarantined: .*{why}") as caught:
            assert mgr.restore(_blank()) == 3
    assert not any("and was quarantined" in str(w.message) for w in caught)
    assert (root / manifest_path(4)).exists() and not list((root / step_dir(4)).glob("quarantined-*"))


@pytest.mark.parametrize("then", ["recovers", "fails"])
def test_damage_the_stored_bytes_do_not_show_quarantines_nothing(tmp_path: Path, then: str) -> None:
    _loop(tmp_path, 4, run=0)
    why = "verify intact now" if then == "recovers" else "could not be checked"
    _not_quarantined(tmp_path, _OnTheWire(tmp_path, then), why)


def test_a_file_under_a_key_the_provider_does_not_hold_quarantines_nothing(tmp_path: Path) -> None:
    """Step 4's manifest authenticates under key B, its file is sealed under key A (a key
    rotated out while a step still references a file under it): the restore passes over it,
    but the file may be intact, so it stays (``KeyNotHeldError``)."""
    pytest.importorskip("cryptography")
    from shardkeeper.core import LocalKeyProvider
    from shardkeeper.core.codec.crypto_format import root_identity
    from shardkeeper.core.codec.crypto_manifest import seal_manifest

    a, b = LocalKeyProvider(b"\xaa" * 32, "key A"), LocalKeyProvider(b"\xbb" * 32, "key B")
    with CheckpointManager(tmp_path, encryption=b, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    with CheckpointManager(tmp_path, encryption=a, async_save=False) as mgr:
        mgr.save(4, _state(4))
    path = tmp_path / manifest_path(4)
    data = path.read_bytes()
    path.write_bytes(seal_manifest(data[: data.rfind(b',"encryption":{')] + b"}", b, root_identity(str(tmp_path))))
    _not_quarantined(tmp_path, tmp_path, "not hold", encryption=b)


def test_a_damaged_newest_step_of_the_persistent_root_through_the_tiers(tmp_path: Path) -> None:
    """With a local tier: the job lost its nodes, the persistent root's newest step is damaged,
    and the old writer's claim of that step is still there (its sweep failed). The tiered
    restore falls back on the persistent root and quarantines the step there; neither its
    manifest nor its claim blocks the save of it, whose upload commits."""
    root = tmp_path / "root"
    with CheckpointManager(root, local=tmp_path / "a", persist_every=1) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step)).wait()
            mgr.wait_persisted()
    shutil.rmtree(tmp_path / "a")
    _damage(root, 4, "flipped")
    (root / claim_path(4)).write_text(json.dumps({"kind": "step-claim", "step": 4, "writer": "0ld0ld00"}))
    with CheckpointManager(root, local=tmp_path / "b", persist_every=1) as mgr:
        with pytest.warns(UserWarning, match=QUARANTINED):
            assert mgr.restore(_blank()) == 3 and mgr.last_restore_tier == "persistent"
        mgr.save(4, _state(4, run=1)).wait()
        mgr.wait_persisted()
        assert mgr.persisted_steps == [4]
    shutil.rmtree(tmp_path / "b")
    got = _blank()
    with CheckpointManager(root, local=tmp_path / "c") as mgr:
        assert mgr.restore(got) == 4 and mgr.last_restore_tier == "persistent"
    assert_same_state(got, _state(4, run=1), what="step 4 saved again through the tiers")


@pytest.mark.multiprocess
def test_two_ranks_quarantine_once_and_go_on(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    res = run_workers(2, "damaged_newest_worker.py", str(root), str(out), timeout_s=100)
    assert res.returncode == 0, res.stdout[-4000:]
    seen = [json.loads((out / f"r{r}.json").read_text()) for r in range(2)]
    flipped = seen[1]["flipped"]
    for s in seen:
        assert s["restored"] == 2 and s["restored_exact"] and s["saved"] == "ok", s
        assert s["step 3 exact"] is True and s["step 4 exact"] is True, s
        (msg,) = s["warnings"]
        assert msg == seen[0]["warnings"][0], "every rank hears the coordinator's one outcome"
        assert "step 3 under" in msg and "digest mismatch" in msg and flipped in msg, msg
    assert len(list((root / step_dir(3)).glob("quarantined-*.manifest.json"))) == 1
