"""``CheckpointOptions`` and the settings reader: types from the dataclass, groups, every
validation rule and its message, the combinations that raise or warn, and the conversion of
settings from mappings, environment variables and YAML/JSON files."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, get_args

import pytest

from shardkeeper.core import CheckpointManager, CheckpointOptions, IneffectiveOptionWarning
from shardkeeper.core.config.options import (
    GROUPS,
    OPTION_NAMES,
    Compression,
    DigestAlgorithm,
    PerRankPolicy,
    Staging,
    group_of,
    option_types,
)
from shardkeeper.core.config.settings import options_from_env, options_from_file, options_from_mapping


class _Provider:
    """A KeyProvider by its protocol (never asked to wrap here)."""

    key_id = "test"

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        raise AssertionError("not used")

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        raise AssertionError("not used")


# -- where it lives, what it is ----------------------------------------------------------------
def test_one_class_under_every_import_path_and_torch_free() -> None:
    from shardkeeper.core.config.options import CheckpointOptions as from_options
    from shardkeeper.core.manager.manager import CheckpointOptions as from_manager

    assert from_manager is from_options is CheckpointOptions
    code = (
        "import sys, shardkeeper.core.config.options, shardkeeper.core.config.settings, shardkeeper.core as c; "
        "c.CheckpointOptions(catalog='etcd://h:1', encryption='env:K'); "
        "print(sorted(m for m in ('torch', 'numpy', 'yaml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_groups_cover_every_field_once() -> None:
    grouped = [n for names in GROUPS.values() for n in names]
    assert sorted(grouped) == sorted(OPTION_NAMES) and len(grouped) == len(set(grouped))
    assert group_of("async_save") == "saving" and group_of("retry_deadline_s") == "retry"
    with pytest.raises(KeyError):
        group_of("asynch_save")


def test_the_options_table_of_the_docs_follows_the_groups() -> None:
    """docs/protocol.md lists every option once, in the group ``GROUPS`` gives it."""
    text = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()
    table = text.split("## Options (`CheckpointOptions`)")[1].split("### Validation")[0]
    listed: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in GROUPS:
            listed.update({name: cells[0] for name in re.findall(r"`(\w+)`", cells[1])})
    assert listed == {name: group_of(name) for name in OPTION_NAMES}


def test_types_are_resolved_from_the_dataclass_and_match_the_implementation() -> None:
    from shardkeeper.core.codec.compression import COMPRESSIONS
    from shardkeeper.core.format.digest import DEFAULT_ALGORITHM, DEFAULT_BLOCK_BYTES, algorithms
    from shardkeeper.core.restore.plan import PER_RANK_POLICIES
    from shardkeeper.core.save.overlap import STAGING_MODES

    hints = option_types()
    assert list(hints) == [f.name for f in dataclasses.fields(CheckpointOptions)]
    assert not any(isinstance(h, str) for h in hints.values())  # real types, not annotation text
    assert (hints["staging"], hints["per_rank"], hints["digest"]) == (Staging, PerRankPolicy, DigestAlgorithm)
    assert hints["compression"] == Compression | None and hints["io_threads"] is int
    # the choices the types declare are the ones the save/restore code implements
    assert get_args(Staging) == STAGING_MODES
    assert get_args(PerRankPolicy) == PER_RANK_POLICIES
    assert get_args(DigestAlgorithm) == algorithms()
    assert set(get_args(Compression)) | {None} == set(COMPRESSIONS)
    d = CheckpointOptions()
    assert (d.digest, d.digest_block_bytes) == (DEFAULT_ALGORITHM, DEFAULT_BLOCK_BYTES)


# -- single values ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value", "exc", "message"),
    [
        ("io_threads", "4", TypeError, "io_threads='4' is of type str; io_threads takes an int"),
        ("io_threads", 4.0, TypeError, "io_threads=4.0 is of type float; io_threads takes an int"),
        ("io_threads", True, TypeError, "io_threads=True is of type bool; io_threads takes an int"),
        ("async_save", "yes", TypeError, "async_save='yes' is of type str; async_save takes True or False"),
        ("async_save", 1, TypeError, "async_save=1 is of type int; async_save takes True or False"),
        ("commit_timeout_s", "60", TypeError, "commit_timeout_s='60' is of type str; commit_timeout_s takes a number"),
        ("staging", "later", ValueError, "staging='later'; choose one of blocking, overlap"),
        ("staging", 1, TypeError, "staging=1 is of type int; staging takes one of blocking, overlap"),
        ("per_rank", "bogus", ValueError, "per_rank='bogus'; choose one of map, exact, modulo, drop"),
        ("digest", "md5", ValueError, "digest='md5'; choose one of xxh3_128, sha256"),
        ("compression", "lz4", ValueError, "compression='lz4'; choose one of zstd, none, None"),
        ("catalog", 3, TypeError, "catalog=3 is of type int; catalog takes a str or None"),
        ("encryption", 5, TypeError, "encryption=5 is of type int; encryption takes a str or a KeyProvider or None"),
        ("encryption", "kms", ValueError, "encryption='kms'; use 'env:VAR', 'file:PATH' or a KeyProvider object"),
        ("encryption", "env:", ValueError, "encryption='env:'; use 'env:VAR', 'file:PATH'"),
        ("catalog", "redis://x", ValueError, "catalog='redis://x': give an etcd endpoint"),
        ("io_threads", 0, ValueError, "io_threads must be >= 1, got 0"),
        ("digest_block_bytes", 12, ValueError, "digest_block_bytes must be a multiple of 8, got 12"),
        ("commit_timeout_s", 0, ValueError, "commit_timeout_s must be > 0, got 0"),
        ("retry_max_attempts", 0, ValueError, "retry max_attempts must be >= 1, got 0"),
        ("retry_base_delay_s", -1.0, ValueError, "retry base_delay_s must be >= 0, got -1.0"),
    ],
)
def test_bad_value_names_option_value_and_choices(option: str, value: Any, exc: type, message: str) -> None:
    with pytest.raises(exc) as e:
        CheckpointOptions(**{option: value})
    assert type(e.value) is exc and str(e.value).startswith(message), str(e.value)


def test_good_values_are_kept_and_an_int_for_a_float_becomes_a_float() -> None:
    provider = _Provider()
    o = CheckpointOptions(commit_timeout_s=60, encryption=provider, compression="none", catalog="etcd://h:1/p")
    assert o.commit_timeout_s == 60.0 and type(o.commit_timeout_s) is float
    assert o.encryption is provider and o.compression == "none"
    assert CheckpointOptions(encryption="file:/k", encryption_root="run-7").encryption_root == "run-7"


# -- combinations ------------------------------------------------------------------------------
def test_encryption_root_without_encryption_raises() -> None:
    with pytest.raises(ValueError, match=r"encryption_root='run-7' without encryption: nothing would be encrypted"):
        CheckpointOptions(encryption_root="run-7")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"staging": "overlap", "async_save": False},
            "staging='overlap' with async_save=False: a synchronous save writes the tensors themselves",
        ),
        ({"compression_level": 1}, "compression_level=1 without compression='zstd': chunks are stored raw"),
        ({"compression": "none", "compression_level": 9}, "compression_level=9 without compression='zstd'"),
        (
            {"describe_layouts": True, "compression": "zstd"},
            "describe_layouts=True with compression='zstd': compression stores large chunks as slabs",
        ),
        (
            {"max_files_per_rank": 1, "min_file_bytes": 1 << 20},
            "min_file_bytes=1048576 with max_files_per_rank=1: a rank always writes one file",
        ),
        (
            {"retry_max_attempts": 1, "retry_deadline_s": 5.0, "retry_max_delay_s": 1.0},
            "retry_max_delay_s=1.0, retry_deadline_s=5.0 with retry_max_attempts=1: nothing is retried",
        ),
    ],
)
def test_ineffective_combinations_warn_at_the_caller(options: dict[str, Any], message: str) -> None:
    with pytest.warns(IneffectiveOptionWarning) as record:
        CheckpointOptions(**options)
    assert len(record) == 1 and str(record[0].message).startswith(message), str(record[0].message)
    assert record[0].filename == __file__  # attributed to the code that set the options


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"staging": "overlap"},
        {"async_save": False},
        {"compression": "zstd", "compression_level": 1},
        {"max_files_per_rank": 1},
        {"retry_max_attempts": 1},
        {"compression_level": 3},
        {"encryption": "env:K", "encryption_root": "r"},
        {"describe_layouts": None, "compression": "zstd"},  # the default: enumerated, as asked
        {"describe_layouts": True, "data_prefixes": 16},
    ],
)
def test_effective_combinations_do_not_warn(options: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointOptions(**options)


FLOAT_OPTIONS = [n for n, h in option_types().items() if h is float]


@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_nan_is_refused_for_every_float_option(tmp_path: Path, name: str) -> None:
    assert len(FLOAT_OPTIONS) == 4  # the durations: commit_timeout_s and the retry_* delays
    with pytest.raises(ValueError, match=rf"^{name}=nan; {name} takes a number of seconds, not nan$"):
        CheckpointManager(tmp_path / "r", **{name: float("nan")})
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match=rf"^{name}=nan"):
        CheckpointOptions().replace(**{name: float("nan")})


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("commit_timeout_s", True),
        ("retry_base_delay_s", True),
        ("retry_max_delay_s", False),
        ("retry_deadline_s", False),
    ],
)
def test_infinity_only_where_it_means_no_bound(tmp_path: Path, name: str, refused: bool) -> None:
    if refused:
        with pytest.raises(ValueError, match=rf"^{name}=inf; {name} takes a finite number of seconds$"):
            CheckpointManager(tmp_path, **{name: float("inf")})
    else:  # no cap on one backoff / no deadline: a save still works
        with CheckpointManager(tmp_path, async_save=False, **{name: float("inf")}) as mgr:
            mgr.save(1, {"x": 1})
            assert mgr.steps() == [1]


def test_manager_warns_at_its_caller_and_lists_close_matches(tmp_path: Path) -> None:
    with pytest.warns(IneffectiveOptionWarning, match="staging='overlap' with async_save=False") as record:
        CheckpointManager(tmp_path / "a", staging="overlap", async_save=False).close()
    assert record[0].filename == __file__
    with pytest.raises(TypeError) as e:
        CheckpointManager(tmp_path / "b", asynch_save=True)
    msg = str(e.value)
    assert msg.startswith(
        "unknown CheckpointManager keyword(s): asynch_save (did you mean async_save?); "
        "the manager's own: keep_last, keep_every, process_group, storage_options, metadata, options, local, "
        "persist_every, replicas, erasure, local_keep; "
        "the options, by group: saving: async_save, staging, writer, commit_timeout_s, commit_group_ranks; layout:"
    ), msg
    with pytest.raises(TypeError, match=r"keyword\(s\): no_such_option; the manager's own"):
        CheckpointManager(tmp_path / "b", no_such_option=1)
    assert not (tmp_path / "b").exists()  # refused before the root is touched
    base = CheckpointOptions(io_threads=2)
    assert base.replace() is base and base.replace(io_threads=3).io_threads == 3
    with pytest.raises(ValueError, match="io_threads must be >= 1"):
        base.replace(io_threads=0)


# -- the settings reader -------------------------------------------------------------------------
def test_every_option_reads_back_from_its_text() -> None:
    """Each field's default, written as text, converts back to itself by the declared type."""
    for f in dataclasses.fields(CheckpointOptions):
        if f.default is None:
            continue
        got = options_from_mapping({f.name: str(f.default)}, source="test")[f.name]
        assert got == f.default and type(got) is type(f.default), f.name


def test_mapping_converts_text_and_checks_parsed_values() -> None:
    provider = _Provider()
    got = options_from_mapping(
        {
            "async_save": "on",
            "incremental": 1,
            "io_threads": " 8 ",
            "retry_base_delay_s": "0.5",
            "staging": "overlap",
            "compression": None,
            "digest": " sha256",
            "encryption": provider,
            "storage_options": '{"anon": true}',
            "keep_last": 3,
        },
        source="test",
        extra={"storage_options": dict[str, Any] | None, "keep_last": int | None},
    )
    assert got == {
        "async_save": True,
        "incremental": True,
        "io_threads": 8,
        "retry_base_delay_s": 0.5,
        "staging": "overlap",
        "compression": None,
        "digest": "sha256",
        "encryption": provider,
        "storage_options": {"anon": True},
        "keep_last": 3,
    }
    CheckpointOptions(**{k: v for k, v in got.items() if k in OPTION_NAMES})  # builds as read


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("io_threads", "four", "shardkeeper setting 'io_threads' from the section is 'four', not a valid int"),
        ("io_threads", 4.5, "shardkeeper setting 'io_threads' from the section is 4.5, not a valid int"),
        ("io_threads", None, "shardkeeper setting 'io_threads' from the section is None, not a valid int"),
        ("async_save", "maybe", "'async_save' from the section is 'maybe', not a valid bool (expected true/false)"),
        ("async_save", 2, "'async_save' from the section is 2, not a valid bool"),
        ("staging", "later", "'staging' from the section is 'later', not one of blocking, overlap"),
        ("compression", "lz4", "'compression' from the section is 'lz4', not one of zstd, none"),
        ("commit_timeout_s", "soon", "'commit_timeout_s' from the section is 'soon', not a valid float"),
        ("catalog", 7, "'catalog' from the section is 7, not a valid str"),
        ("encryption", 7, "'encryption' from the section is 7, not a valid str or KeyProvider"),
        ("storage_options", "[1]", "'storage_options' from the section is '[1]', not a valid mapping"),
        ("storage_options", "{", "'storage_options' from the section is '{', not a valid mapping (not JSON"),
    ],
)
def test_mapping_errors_name_source_key_and_type(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as e:
        options_from_mapping({key: value}, source="the section", extra={"storage_options": dict[str, Any] | None})
    assert message in str(e.value), str(e.value)


def test_mapping_unknown_keys_list_close_matches_and_groups() -> None:
    with pytest.raises(ValueError) as e:
        options_from_mapping(
            {"asynch_save": 1, "keep_lats": 3, "zzz": 0}, source="config file /x.yaml", extra={"keep_last": int | None}
        )
    msg = str(e.value)
    assert msg.startswith(
        "config file /x.yaml: unknown setting(s) asynch_save (did you mean async_save?), "
        "keep_lats (did you mean keep_last or keep_best?), zzz; known, by group: saving: async_save"
    ), msg
    assert msg.endswith("retention: keep_best; others: keep_last"), msg
    with pytest.raises(ValueError, match=r"^the section must be a mapping of settings, got list$"):
        options_from_mapping(["io_threads"], source="the section")  # type: ignore[arg-type]


def test_env_reads_shardkeeper_variables_by_declared_type() -> None:
    env = {
        "SHARDKEEPER_IO_THREADS": "8",
        "SHARDKEEPER_ASYNC_SAVE": "0",
        "SHARDKEEPER_STAGING": "",
        "SHARDKEEPER_ROOT": "/r",
        "SHARDKEEPER_ASYNCH_SAVE": "1",
        "OTHER": "x",
    }
    assert options_from_env(env, extra={"root": str | None}) == {"io_threads": 8, "async_save": False, "root": "/r"}
    assert options_from_env({"X_IO_THREADS": "2"}, prefix="X_") == {"io_threads": 2}
    with pytest.raises(ValueError, match=r"'digest' from \$SHARDKEEPER_DIGEST is 'md5', not one of xxh3_128, sha256"):
        options_from_env({"SHARDKEEPER_DIGEST": "md5"})


def test_files_yaml_and_json(tmp_path: Path) -> None:
    y = tmp_path / "s.yaml"
    y.write_text("async_save: false\nio_threads: 2\ncompression: zstd\nstaging: overlap\n")
    assert options_from_file(y) == {"async_save": False, "io_threads": 2, "compression": "zstd", "staging": "overlap"}
    j = tmp_path / "s.json"
    j.write_text('{"retry_max_attempts": "7", "catalog": null}')
    assert options_from_file(j) == {"retry_max_attempts": 7, "catalog": None}
    (tmp_path / "empty.yaml").write_text("")
    assert options_from_file(tmp_path / "empty.yaml") == {}
    y.write_text("io_threads: many\n")
    with pytest.raises(ValueError, match=rf"'io_threads' from config file {y} is 'many', not a valid int"):
        options_from_file(y)
    y.write_text("io_thread: 2\n")
    with pytest.raises(ValueError, match=rf"^config file {y}: unknown setting\(s\) io_thread \(did you mean io_thr"):
        options_from_file(y)
    y.write_text("a: [\n")
    with pytest.raises(ValueError, match=rf"shardkeeper config file {y} is not valid YAML"):
        options_from_file(y)
    j.write_text("{")
    with pytest.raises(ValueError, match=rf"shardkeeper config file {j} is not valid JSON"):
        options_from_file(j)
    j.write_text("[1]")
    with pytest.raises(ValueError, match=rf"shardkeeper config file {j} must hold a mapping of settings, got list"):
        options_from_file(j)


def test_literal_types_are_not_strings_in_the_dataclass() -> None:
    """``from __future__ import annotations`` keeps annotations as text; the reader resolves them."""
    assert CheckpointOptions.__annotations__["staging"] == "Staging"
    assert option_types()["staging"] == Literal["blocking", "overlap"]
