"""The ``shardkeeper`` command: ls, inspect, verify, gc, export, import and advise.

Runs without torch, so an operator can look after a bucket from any machine::

    shardkeeper ls s3://bucket/run-42
    shardkeeper inspect /data/run 1200 --keys 'model/*'
    shardkeeper verify /data/run            # exit 0 clean, 1 damaged, 2 usage / nothing there
    shardkeeper gc /data/run --dry-run
    shardkeeper export /data/run 1200 --to ./hf-model      # Hugging Face safetensors + index
    shardkeeper import ./dcp-ckpt /data/run --step 1200 --trust-pickle
    shardkeeper advise /data/run --mtbf 3h --interval 30m   # Young/Daly checkpoint interval

Exit codes: 0 success; 1 damage found (verify) or a removal failed (gc); 2 usage error, no
checkpoint where one was asked for, or any other error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.commit import committed_steps, load_manifest, step_dirs
from shardkeeper.core.display import (
    PrintableFormatter,
    human_size,
    preview,
    printable,
    say,
    table_lines,
)
from shardkeeper.core.display import format_table as format_table  # re-exported
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
)
from shardkeeper.core.format.layout import LATEST_NAME
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.garbage import DEFAULT_GC_MIN_AGE_S, collect_garbage
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify import Problem, RootVerifyReport, verify_root, verify_step

PROG = "shardkeeper"
EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A bad argument or nothing to work on: exit 2 with one line on stderr."""


# --------------------------------------------------------------------------------------------
# Formatting (human output goes through display.say: manifest strings are untrusted)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))  # ASCII escapes: no control character


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# --------------------------------------------------------------------------------------------
# Shared


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--storage-option expects KEY=VALUE, got {text!r}")
    try:
        # true/false/null, numbers, and objects (s3fs's client_kwargs={"endpoint_url": ...});
        # anything that is not JSON stays a string ('"123"' forces the string "123").
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


KEY_HELP = (
    "the key-encryption key of an encrypted checkpoint: env:VAR (base64 in $VAR) or file:PATH; "
    "with it, data blocks are decrypted and authenticated and the manifest's MAC checked"
)


def _open(args: argparse.Namespace) -> Storage:
    options = dict(_parse_option(o) for o in args.storage_option or ())
    try:
        return open_storage(args.root, **options)
    except TypeError as e:
        raise UsageError(f"bad --storage-option for {args.root}: {e}") from None
    except ImportError as e:
        raise UsageError(
            f"cannot open {args.root}: {e}; install the backend's extra, e.g. "
            f"`pip install 'shardkeeper-core[s3]'` or `'shardkeeper-core[gcs]'`"
        ) from None


def _latest_hint(storage: Storage) -> int | None:
    try:
        return int(storage.read_bytes(LATEST_NAME).decode().strip())
    except (CheckpointError, ValueError, UnicodeDecodeError):
        return None


def _resolve_step(storage: Storage, step: int | None) -> int:
    if step is not None:
        return step
    steps = committed_steps(storage)
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")
    return steps[-1]


def _stored_bytes(m: Manifest) -> int:
    return sum(int(f.get("size_bytes", 0)) for f in m.files.values() if isinstance(f, dict))


# --------------------------------------------------------------------------------------------
# Commands


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _open(args)
    latest = _latest_hint(storage)
    committed = set(committed_steps(storage))
    rows: list[dict[str, Any]] = []
    for step, name in sorted(step_dirs(storage).items()):
        row: dict[str, Any] = {
            "step": step,
            "status": "committed",
            "size_bytes": None,
            "logical_bytes": None,
            "leaves": None,
            "world_size": None,
            "created_at": None,
            "latest_hint": step == latest,
        }
        if step in committed:
            try:
                m = load_manifest(storage, step)
            except IncompatibleFormatError:
                row["status"] = "newer-format"
            except CheckpointError:
                row["status"] = "invalid"  # damaged or deleted since the listing
            else:
                row.update(
                    size_bytes=_stored_bytes(m),
                    logical_bytes=m.nbytes,
                    leaves=len(m.leaves),
                    world_size=m.world_size,
                    created_at=m.created_at or None,
                )
        else:
            try:
                names = [n.rstrip("/").rsplit("/", 1)[-1] for n in storage.list_dir(name)]
            except CorruptCheckpointError:  # cannot be listed for what it is: damage
                names = [MANIFEST_NAME]
            row["status"] = "invalid" if MANIFEST_NAME in names else "uncommitted"
        rows.append(row)

    if args.json:
        _print_json({"root": storage.url, "latest_hint": latest, "steps": rows})
        return EXIT_OK
    if not rows:
        say(f"no checkpoints under {storage.url}")
        return EXIT_OK
    table = [
        [
            r["step"],
            r["status"],
            human_size(r["size_bytes"]) if r["size_bytes"] is not None else "-",
            r["leaves"] if r["leaves"] is not None else "-",
            r["world_size"] if r["world_size"] is not None else "-",
            r["created_at"] or "-",
            "LATEST" if r["latest_hint"] else "",
        ]
        for r in rows
    ]
    say(*table_lines(["STEP", "STATUS", "SIZE", "LEAVES", "WORLD", "CREATED", ""], table, "rlrrrll"))
    if latest is not None and latest not in committed:
        say(f"note: the LATEST hint says step {latest}, which is not committed; readers ignore it")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _open(args)
    step = _resolve_step(storage, args.step)
    m = load_manifest(storage, step)
    patterns = args.keys or []
    keys = [k for k in m.leaves if not patterns or any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    if patterns and not keys:
        raise UsageError(f"no key of step {step} matches {' or '.join(patterns)}")

    leaves = []
    for k in keys:
        leaf = m.leaves[k]
        if leaf.kind == "object":
            leaves.append({"key": k, "kind": "object", "value": leaf.value})
        else:
            leaves.append({
                "key": k,
                "kind": leaf.kind,
                "dtype": leaf.dtype,
                "shape": list(leaf.shape),
                "chunks": len(leaf.chunks),
                "size_bytes": leaf.nbytes,
                "stored_bytes": sum(c.length for c in leaf.chunks),
            })
    if args.json:
        _print_json({
            "root": storage.url,
            "step": m.step,
            "format_version": m.format_version,
            "created_at": m.created_at,
            "attempt": m.attempt,
            "world_size": m.world_size,
            "digest_algorithm": m.digest_algorithm,
            "digest_block_bytes": m.digest_block_bytes,
            "per_rank_prefixes": list(m.per_rank_prefixes),
            "metadata": m.metadata,
            "files": len(m.files),
            "size_bytes": _stored_bytes(m),
            "logical_bytes": m.nbytes,
            "leaves": leaves,
        })
        return EXIT_OK

    head = [
        ("root", storage.url),
        ("step", m.step),
        ("format version", m.format_version),
        ("created at", m.created_at or "-"),
        ("attempt", m.attempt or "-"),
        ("world size", m.world_size),
        ("digest", f"{m.digest_algorithm}, {human_size(m.digest_block_bytes)} blocks"),
        ("files", f"{len(m.files)}, {human_size(_stored_bytes(m))}"),
        ("leaves", f"{len(m.leaves)}, {human_size(m.nbytes)} of tensors and bytes"),
    ]
    if m.per_rank_prefixes:
        head.append(("per-rank", ", ".join(m.per_rank_prefixes)))
    for k, v in sorted(m.metadata.items()):
        head.append((f"metadata.{k}", v if isinstance(v, str) else preview(v, 80)))
    head = [(printable(k), v) for k, v in head]  # escaped before padding
    width = max(len(k) for k, _ in head)
    say(*(f"{k.ljust(width)}  {v}" for k, v in head), "")
    table = []
    for row in leaves:
        if row["kind"] == "object":
            table.append([row["key"], "object", "", "", "", "", preview(row["value"])])
        else:
            table.append([row["key"], row["kind"], row["dtype"], _shape(row["shape"]),
                          row["chunks"], human_size(row["size_bytes"]), ""])
    say(*table_lines(["KEY", "KIND", "DTYPE", "SHAPE", "CHUNKS", "SIZE", "VALUE"], table, "lllrrrl"))
    return EXIT_OK


def _print_problems(problems: Sequence[Problem]) -> None:
    for p in problems:
        say(f"  - {p.message}")


def _with_key(storage: Storage, spec: str | None, encryption_root: str | None = None) -> Storage:
    """``storage`` that decrypts and authenticates with the key ``spec`` (``--key``)."""
    if spec is None:
        return storage
    from shardkeeper.core.codec.crypto import EncryptedStorage
    from shardkeeper.core.codec.keys import key_provider

    try:
        provider = key_provider(spec)
    except (ValueError, OSError) as e:
        raise UsageError(f"bad --key {spec!r}: {e}") from None
    except ImportError as e:
        raise UsageError(f"--key needs the [crypto] extra: {e}") from None
    assert provider is not None
    return EncryptedStorage(storage, provider, root=encryption_root).authenticated()


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _with_key(_open(args), args.key, args.encryption_root)
    if args.step is not None:
        try:
            reports = [verify_step(storage, args.step)]
        except CorruptCheckpointError as e:
            # The manifest exists but does not validate: that is damage, not a usage error.
            root = RootVerifyReport(root=storage.url, problems=[Problem(
                step=args.step, kind="manifest", file="",
                message=f"step {args.step}: the manifest does not validate: {e}")])
        else:
            root = RootVerifyReport(root=storage.url, steps=reports)
    else:
        root = verify_root(storage)
        if not root.steps and not root.problems:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")

    if args.json:
        _print_json(root.to_json())
        return EXIT_OK if root.ok else EXIT_DAMAGED

    for p in root.problems:
        say(p.message)
    for r in root.steps:
        if r.ok:
            say(f"step {r.step}: OK ({r.files_checked} files, {r.chunks_checked} chunks, "
                  f"{human_size(r.bytes_checked)} checked)")
        else:
            say(f"step {r.step}: DAMAGED ({len(r.problems)} problem(s))")
            _print_problems(r.problems)
    bad = len(root.all_problems)
    if bad:
        say(f"verify: {bad} problem(s) under {storage.url}", file=sys.stderr)
        return EXIT_DAMAGED
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    storage = _open(args)
    if args.min_age_s < 0:
        raise UsageError(f"--min-age-s must be >= 0, got {args.min_age_s}")
    report = collect_garbage(storage, min_age_s=args.min_age_s, dry_run=args.dry_run)
    if args.json:
        _print_json(report.to_json())
        return EXIT_DAMAGED if report.errors else EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for p in report.removed_paths:
        say(f"{verb} {storage.describe(p)}")
    for p in report.skipped_young:
        say(f"kept {storage.describe(p)} (younger than {args.min_age_s:g} s: a save may be "
              f"running)")
    if report.kept_referenced:
        say(f"kept {len(report.kept_referenced)} file(s) of deleted steps that committed "
              f"steps reference")
    for p in report.kept_in_flight:
        say(f"kept {storage.describe(p)} (a commit in progress needs it)")
    for e in report.errors:
        say(f"{PROG}: error: {e}", file=sys.stderr)
    n = len(report.removed_paths)
    say(f"gc: {verb} {n} path(s), {human_size(report.removed_bytes)}"
          + (" (dry run)" if args.dry_run else ""))
    return EXIT_DAMAGED if report.errors else EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from shardkeeper.core.export import export_safetensors

    storage = _with_key(_open(args), args.key, args.encryption_root)
    res = export_safetensors(
        storage, args.step, to=args.to, keys=args.keys or ["model/*"], keep_prefix=args.keep_prefix,
        max_shard_size=args.max_shard_size, progress=None if args.progress is None else args.progress,
    )
    say(f"exported step {res.step}: {len(res.weight_map)} tensors, {human_size(res.total_size)} in "
          f"{len(res.files)} file(s) to {res.directory}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from shardkeeper.core.dcp_import import import_dcp

    storage = _open(args)
    m = import_dcp(args.source, storage, step=args.step, trust_pickle=args.trust_pickle,
                   progress=args.progress)
    say(f"imported {args.source} as step {m.step} under {storage.url}: {len(m.leaves)} leaves, "
          f"{human_size(m.nbytes)}")
    return EXIT_OK


def cmd_advise(args: argparse.Namespace) -> int:
    from shardkeeper.core import advisor

    try:
        if args.mtbf is not None:
            mtbf = advisor.parse_duration(args.mtbf)
        elif args.restarts is not None and args.elapsed is not None:
            mtbf = advisor.mtbf_from_restarts(args.restarts, advisor.parse_duration(args.elapsed))
        else:
            raise UsageError("give --mtbf DURATION, or the job's restart history: --restarts N --elapsed DURATION")
        interval = advisor.parse_duration(args.interval) if args.interval is not None else None
        restart = advisor.parse_duration(args.restart_cost) if args.restart_cost is not None else 0.0
        if args.cost is not None:
            advice = advisor.advise(
                mtbf_s=mtbf, interval_s=interval, cost_s=advisor.parse_duration(args.cost),
                durable_s=advisor.parse_duration(args.durable or "0"), sync=args.sync, restart_s=restart)
        else:
            storage = _open(args)
            advice = advisor.advise_root(storage, mtbf_s=mtbf, interval_s=interval, last=args.last,
                                         restart_s=restart)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        _print_json(advice.to_json())
    else:
        say(*advice.summary().splitlines())
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# Entry point


def _step_arg(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"STEP must be a non-negative integer, got {text!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"STEP must be a non-negative integer, got {text!r}")
    return step


def _progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress on stderr (default: when stderr is a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("root", metavar="ROOT", help="checkpoint root: a path or an fsspec URL")
    common.add_argument(
        "--storage-option", "-o", action="append", metavar="KEY=VALUE", default=[],
        help="passed to the storage backend (repeatable); VALUE is parsed as JSON when it can be, "
        "e.g. -o anon=true -o 'client_kwargs={\"endpoint_url\": \"http://minio:9000\"}'",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify and clean shardkeeper checkpoint roots."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("ls", parents=[common], help="list checkpoints under ROOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="show one checkpoint's metadata and leaves")
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_arg,
                   help="the step (default: the newest committed)")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="only keys matching this glob, e.g. 'model/*' (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", parents=[common],
                       help="check files, sizes and every digest; exit 1 on damage")
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_arg,
                   help="the step (default: every committed step)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--key", metavar="SPEC", help=KEY_HELP)
    p.add_argument("--encryption-root", metavar="ROOT", help="the root an encrypted checkpoint was "
                   "written under, when it was moved or copied since (default: ROOT itself)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", parents=[common],
                       help="remove leftovers of failed saves and unreferenced files")
    p.add_argument("--min-age-s", type=float, default=DEFAULT_GC_MIN_AGE_S, metavar="N",
                   help=f"only remove leftovers older than N seconds (default "
                   f"{DEFAULT_GC_MIN_AGE_S:g}); must exceed the longest save")
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export", parents=[common],
                       help="write a step as Hugging Face safetensors shards + index")
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_arg,
                   help="the step (default: the newest committed)")
    p.add_argument("--to", required=True, metavar="DIR", help="output directory (local)")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="tensor keys to export (glob, repeatable; default 'model/*')")
    p.add_argument("--keep-prefix", action="store_true",
                   help="keep the 'model/' prefix in the exported names")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest shard file, e.g. 5GB, 500MB (default 5GB)")
    _progress_flags(p)
    p.add_argument("--key", metavar="SPEC", help=KEY_HELP)
    p.add_argument("--encryption-root", metavar="ROOT", help="the root an encrypted checkpoint was "
                   "written under, when it was moved or copied since (default: ROOT itself)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("advise", parents=[common],
                       help="the optimal checkpoint interval (Young/Daly) from recorded save timings")
    p.add_argument("--mtbf", metavar="DURATION", help="mean time between failures, e.g. 3h, 45m, 2d")
    p.add_argument("--restarts", type=int, metavar="N",
                   help="instead of --mtbf: failures (restarts) the job had in --elapsed")
    p.add_argument("--elapsed", metavar="DURATION", help="wall time over which --restarts happened")
    p.add_argument("--interval", metavar="DURATION", help="the current interval, to compare")
    p.add_argument("--restart-cost", metavar="DURATION", help="time to restart after a failure")
    p.add_argument("--last", type=int, default=10, metavar="N",
                   help="use the timings of the newest N steps (default 10)")
    p.add_argument("--cost", metavar="DURATION",
                   help="instead of the recorded timings: training time lost per checkpoint")
    p.add_argument("--durable", metavar="DURATION",
                   help="with --cost: how long after the stall a checkpoint is committed")
    p.add_argument("--sync", action="store_true", default=None, help="with --cost: synchronous saves")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_advise)

    imp = argparse.ArgumentParser(add_help=False)
    imp.add_argument("source", metavar="DCP_DIR", help="a torch.distributed.checkpoint directory")
    p = sub.add_parser("import", parents=[imp, common],
                       help="write a torch.distributed.checkpoint directory as a committed step")
    p.add_argument("--step", type=_step_arg, required=True, metavar="N", help="the step to commit")
    p.add_argument("--trust-pickle", action="store_true",
                   help="required: DCP's .metadata is a pickle, which can run code; pass it "
                   "only for checkpoints you trust")
    _progress_flags(p)
    p.set_defaults(func=cmd_import)
    return parser


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    say(f"{PROG}: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage line on bad arguments
    # Log records and warnings reach stderr escaped, like every other line (display.say).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _run(args)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        say(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK  # `shardkeeper ls ... | head`
    except (UsageError, CheckpointError, OSError, ValueError) as e:
        if args.debug:
            raise
        say(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - a bug still gets one line; --debug shows it
        if args.debug:
            raise
        say(f"{PROG}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
            file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
