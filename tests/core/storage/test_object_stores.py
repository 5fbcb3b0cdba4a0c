"""The core suite's multi-process paths on the real object-store servers: a 2-rank
FSDP2 + DTensor async save restored at 3 ranks whole and in part, then the CLI (`ls`,
`inspect`, `verify`, `gc`) and damage on the store: a flipped byte and a truncated file are
reported by key and file, a restore of that step fails naming it, and "restore the newest"
falls back to the previous step at another world size (1 process), bit for bit."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.cli import main
from shardkeeper.core.format.layout import step_dir
from tests.checks import assert_same_state

from ..dist.codecs_worker import _full, _linear

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _cli(capsys, url: str, options: dict, *argv: str) -> tuple[int, str]:
    opts = [a for k, v in options.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    code = main([argv[0], url, *argv[1:], *opts])
    out, err = capsys.readouterr()
    return code, out + err


def _restore_whole(url: str, options: dict, step: int | None = None) -> tuple[int, dict]:
    lin = _linear(99)
    extra = {k: torch.zeros_like(t) for k, t in _full().items()}
    with CheckpointManager(url, storage_options=options) as mgr:
        got = mgr.restore({"model": lin, "extra": extra}, step=step)
    return got, {
        "model/weight": lin.weight.detach(),
        "model/bias": lin.bias.detach(),
        **{f"extra/{k}": v for k, v in extra.items()},
    }


def test_object_stores_reshard_cli_and_damage(every_storage_root, tmp_path, capsys, caplog) -> None:
    stores = {n: r for n, r in every_storage_root.items() if n != "local"}
    if not stores:
        pytest.skip("no object-store server is installed")
    runs = [{"name": n, "url": r.url, "options": r.options, "mode": "plain"} for n, r in stores.items()]
    if "s3" in stores:  # incremental references and zstd frames through an object store too
        runs.append(
            {
                "name": "s3-codecs",
                "url": stores["s3"].url + "-codecs",
                "options": stores["s3"].options,
                "mode": "codecs",
            }
        )
    from .._launch import run_codecs_worker

    checks = run_codecs_worker(tmp_path, runs, timeout_s=240)
    assert len(checks) == len(runs) * (2 + 3 * 3), [c["name"] for c in checks]

    full, ref = _full(), _linear(1)
    step1 = {
        "model/weight": ref.weight.detach(),
        "model/bias": ref.bias.detach(),
        **{f"extra/{k}": v for k, v in full.items()},
    }
    for name, root in stores.items():
        url, options = root.url, root.options
        code, out = _cli(capsys, url, options, "ls", "--json")
        assert code == 0, out
        assert [(s["step"], s["status"]) for s in json.loads(out)["steps"]] == [(1, "committed"), (2, "committed")]
        code, out = _cli(capsys, url, options, "inspect", "2", "--json")
        assert code == 0 and "model/weight" in out, out
        code, out = _cli(capsys, url, options, "verify")
        assert code == 0 and "step 1: OK" in out and "step 2: OK" in out, (name, out)

        storage = root.open()
        with CheckpointManager(url, storage_options=options) as mgr:
            m2 = mgr.manifest(2)
        flipped = m2.leaves["model/weight"].chunks[0]
        truncated = next(c for c in m2.leaves["extra/mask"].chunks if c.file != flipped.file)
        sd = step_dir(2)
        data = bytearray(storage.read_bytes(f"{sd}/{flipped.file}"))
        data[flipped.offset + 3] ^= 0x10
        storage.put(f"{sd}/{flipped.file}", bytes(data))
        data = storage.read_bytes(f"{sd}/{truncated.file}")
        storage.put(f"{sd}/{truncated.file}", data[:-100])

        code, out = _cli(capsys, url, options, "verify", "--json")
        assert code == 1, (name, out)
        doc = json.loads(out)
        by_step = {s["step"]: s for s in doc["steps"]}
        assert by_step[1]["problems"] == [], (name, by_step[1])
        problems = by_step[2]["problems"]
        assert any(
            p["key"] == "model/weight" and p["kind"] == "digest" and flipped.file in p["file"] for p in problems
        ), (name, problems)
        assert any(p["kind"] == "size" and truncated.file in p["file"] for p in problems), (name, problems)

        with pytest.raises(CorruptCheckpointError) as e:
            _restore_whole(url, options, step=2)
        assert "step 2" in str(e.value), (name, str(e.value))
        code, out = _cli(capsys, url, options, "gc", "--min-age-s", "0", "--json")
        assert code == 0, out
        with CheckpointManager(url, storage_options=options) as mgr:
            assert mgr.steps() == [1, 2], name  # gc never removes a committed step, damaged or not
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match=r"step 2 under .* is damaged"):
            got, restored = _restore_whole(url, options)
        assert got == 1, name
        assert any(
            "restored step 1" in r.getMessage() and "damaged step(s) 2" in r.getMessage() and url in r.getMessage()
            for r in caplog.records
        ), caplog.text
        assert_same_state(restored, step1, what=f"{name}: the fallback restore of step 1")
        # the fallback quarantined step 2 on the store (its manifest aside, its files kept)
        code, out = _cli(capsys, url, options, "ls", "--json")
        assert [r["status"] for r in json.loads(out)["steps"]] == ["committed", "quarantined"], (name, out)
        code, out = _cli(capsys, url, options, "verify", "2", "--quarantined")
        assert code == 1 and flipped.file in out, (name, out)
