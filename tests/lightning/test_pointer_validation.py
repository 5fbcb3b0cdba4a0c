"""A pointer file's fields are checked with their exact types, at the one place pointers are
parsed, so the inference loader, ``load_from_checkpoint`` and ``fit(ckpt_path=pointer)`` all
refuse a damaged or altered pointer with one error naming the pointer, the field, what was
found and the remedy; a file that starts like a pointer (the core's zip, or a bare ``{``) but
does not parse never reaches ``torch.load``; real ``.ckpt`` files still go to Lightning's loader."""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import shardkeeper.lightning as skl
from shardkeeper.core.errors import CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.pointer import MEMBER, pointer_document
from shardkeeper.lightning.loading import is_pointer
from shardkeeper.lightning.paths import read_pointer
from tests.checks import assert_same_state
from tests.lightning.common import HNet, cpu_trainer, loader

REMEDY = r"Resume from the checkpoint root itself.*ckpt_path=.*load_checkpoint\("


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run saved through the plugin (one epoch: step 8), and its pointer's document."""
    tmp = tmp_path_factory.mktemp("pointers")
    L.seed_everything(0)
    net = HNet(lr=0.01)
    t = cpu_trainer(tmp, skl.ShardkeeperCheckpointIO(tmp / "root"))
    t.fit(net, loader())
    t.save_checkpoint(tmp / "good.ckpt")
    return {
        "tmp": tmp,
        "root": tmp / "root",
        "step": t.global_step,
        "doc": pointer_document((tmp / "good.ckpt").read_bytes()),
        "bytes": (tmp / "good.ckpt").read_bytes(),
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
    }


def _pointer(run: dict[str, Any], tmp: Path, name: str = "bad.ckpt", **fields: Any) -> Path:
    """A copy of the run's pointer with ``fields`` changed (a field set to ``...``: removed)."""
    doc = {**run["doc"], **fields}
    doc = {k: v for k, v in doc.items() if v is not ...}
    path = tmp / name
    path.write_bytes(_zipped(json.dumps(doc).encode()))
    return path


def _zipped(document: bytes) -> bytes:
    """A pointer file's zip holding ``document`` as its JSON member (and nothing for torch)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(MEMBER, document)
    return out.getvalue()


BAD_FIELDS = [
    ({"step": True}, "step", r"bool True"),  # was step 1
    ({"step": "16"}, "step", r"str '16'"),
    ({"step": 16.0}, "step", r"float 16\.0"),
    ({"step": ...}, "step", r"nothing \(the field is missing\)"),  # was a bare KeyError: 'step'
    ({"step": "abc"}, "step", r"str 'abc'"),
    ({"step": None}, "step", r"NoneType None"),
    ({"step": -1}, "step", r"int -1"),
    ({"root": None}, "root", r"NoneType None"),  # was the path "None"
    ({"root": 5}, "root", r"int 5"),
    ({"root": ["/etc"]}, "root", r"list \['/etc'\]"),
    ({"root": ""}, "root", r"str ''"),
    ({"version": "1"}, "version", r"str '1'"),
    ({"version": True}, "version", r"bool True"),
    ({"version": 0}, "version", r"int 0"),
    ({"version": ...}, "version", r"nothing"),
    ({"root_relative": 5}, "root_relative", r"int 5"),
]


@pytest.mark.parametrize(("fields", "field", "found"), BAD_FIELDS, ids=[f"{f}" for f, _, _ in BAD_FIELDS])
def test_every_field_is_checked_with_its_exact_type(
    run: dict[str, Any], tmp_path: Path, fields: dict[str, Any], field: str, found: str
) -> None:
    bad = _pointer(run, tmp_path, **fields)
    pattern = rf"pointer {re.escape(str(bad))} is damaged: field '{field}' must be .*found {found}.*{REMEDY}"
    with pytest.raises(CorruptCheckpointError, match=pattern):
        skl.load_checkpoint(bad)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        HNet.load_from_checkpoint(bad)  # the hooked Lightning loader


def test_the_remedy_names_the_root_when_the_root_field_is_sound(run: dict[str, Any], tmp_path: Path) -> None:
    bad = _pointer(run, tmp_path, step="8")
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"ckpt_path={str(run['root'])!r}")):
        skl.load_checkpoint(bad)


def test_what_was_found_is_bounded(run: dict[str, Any], tmp_path: Path) -> None:
    bad = _pointer(run, tmp_path, root={"x" * 5000: 1})
    with pytest.raises(CorruptCheckpointError, match=r"found dict \{'xxx.*\.\.\.") as e:
        skl.load_checkpoint(bad)
    assert len(str(e.value)) < 800


def test_a_newer_pointer_version_is_refused_naming_the_upgrade(run: dict[str, Any], tmp_path: Path) -> None:
    bad = _pointer(run, tmp_path, version=99)  # was loaded without complaint
    pattern = rf"pointer {re.escape(str(bad))} has version 99: written by a newer shardkeeper.*upgrade.*{REMEDY}"
    with pytest.raises(IncompatibleFormatError, match=pattern):
        skl.load_checkpoint(bad)
    with pytest.raises(IncompatibleFormatError, match=pattern):
        HNet.load_from_checkpoint(bad)


def test_unknown_extra_fields_are_ignored(run: dict[str, Any], tmp_path: Path) -> None:
    ok = _pointer(run, tmp_path, comment="added by hand", future={"a": [1, 2]})
    assert_same_state(skl.load_checkpoint(ok)["state_dict"], run["state"], what="a pointer with extra fields")


@pytest.mark.parametrize(
    "damage",
    ["truncated", "leading-space", "not-a-pointer", "array-in-braces", "oversized", "zip-truncated", "zip-not-json"],
)
def test_a_damaged_pointer_raises_the_clear_error_never_torch_loads_error(
    run: dict[str, Any], tmp_path: Path, damage: str
) -> None:
    good = json.dumps(run["doc"]).encode()
    data = {
        "truncated": good[: len(good) // 2],
        "leading-space": b"  \n" + good[:-1],
        "not-a-pointer": b'{"some": "json"}',
        "array-in-braces": b"{[1, 2]}",
        "oversized": b"{" + b" " * (1 << 17) + b"}",
        "zip-truncated": run["bytes"][: len(run["bytes"]) // 2],
        "zip-not-json": _zipped(good[:-1]),
    }[damage]
    bad = tmp_path / "damaged.ckpt"
    bad.write_bytes(data)
    pattern = rf"shardkeeper pointer {re.escape(str(bad))} is damaged: .*{REMEDY}"
    for load in (skl.load_checkpoint, HNet.load_from_checkpoint):
        with pytest.raises(CorruptCheckpointError, match=pattern) as e:
            load(bad)
        assert "weights_only" not in str(e.value)  # torch.load's hint to unpickle the file: never reached
    t = cpu_trainer(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        t.test(HNet(), dataloaders=loader(), ckpt_path=str(bad))  # no plugin: the hooked loader


def test_fit_from_a_bad_pointer_raises_the_same_error_on_every_path(run: dict[str, Any], tmp_path: Path) -> None:
    for fields, cls in (({"step": True}, CorruptCheckpointError), ({"version": 99}, IncompatibleFormatError)):
        bad = _pointer(run, tmp_path, **fields)
        t = cpu_trainer(tmp_path / "resume", skl.ShardkeeperCheckpointIO(tmp_path / "resume-root"), epochs=2)
        with pytest.raises(cls, match=rf"pointer {re.escape(str(bad))} .*{REMEDY}"):
            t.fit(HNet(lr=0.01), loader(), ckpt_path=str(bad))
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(json.dumps(run["doc"]).encode()[:20])
    t = cpu_trainer(tmp_path / "resume", skl.ShardkeeperCheckpointIO(tmp_path / "resume-root"), epochs=2)
    with pytest.raises(
        CorruptCheckpointError, match=rf"pointer {re.escape(str(damaged))} is damaged: .*does not parse"
    ):
        t.fit(HNet(lr=0.01), loader(), ckpt_path=str(damaged))


def test_real_ckpt_files_still_go_to_lightnings_loader(tmp_path: Path) -> None:
    from lightning.pytorch.core import saving

    ck = {"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}
    zipped, legacy = tmp_path / "zip.ckpt", tmp_path / "legacy.ckpt"
    torch.save(ck, zipped)
    torch.save(ck, legacy, _use_new_zipfile_serialization=False)
    assert zipped.read_bytes()[:2] == b"PK" and legacy.read_bytes()[:1] == b"\x80"
    for path in (zipped, legacy):
        assert not is_pointer(path) and read_pointer(str(path)) is None
        got = saving.pl_load(path)  # the hooked loader, handing the file to Lightning's own
        assert got["epoch"] == 2 and torch.equal(got["state_dict"]["w"], ck["state_dict"]["w"])


def test_object_store_roots_are_kept_http_roots_refused(run: dict[str, Any], tmp_path: Path) -> None:
    s3 = read_pointer(str(_pointer(run, tmp_path, name="s3.ckpt", root="s3://bucket/run-42", root_relative=...)))
    assert s3 is not None and (s3.root, s3.step) == ("s3://bucket/run-42", run["step"])
    for url in ("http://host/run-42", "HTTPS://host/run-42"):
        bad = _pointer(run, tmp_path, root=url, root_relative=...)
        with pytest.raises(
            CorruptCheckpointError, match=rf"pointer {re.escape(str(bad))} is damaged: field 'root' is an http\(s\) URL"
        ):
            skl.load_checkpoint(bad)


def test_removing_a_damaged_pointer_removes_it_and_forgets_its_path(tmp_path: Path) -> None:
    """Lightning removing (or overwriting) a path whose pointer is damaged: rank 0 must not
    raise alone inside the collective removal; the file goes and the root's index forgets it."""
    L.seed_everything(0)
    t = cpu_trainer(tmp_path, skl.ShardkeeperCheckpointIO(tmp_path / "root"))
    t.fit(HNet(), loader())
    path = tmp_path / "a.ckpt"
    t.save_checkpoint(path)
    path.write_bytes(path.read_bytes()[:100])
    t.strategy.remove_checkpoint(path)
    assert not path.exists()
    index = json.loads((tmp_path / "root" / "lightning-paths.json").read_text())
    assert str(path) not in index["paths"]
