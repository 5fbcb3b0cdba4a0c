"""Commands that show what is under a root: ``ls`` (every step and its state) and ``inspect``
(one step's metadata and leaves). Human output goes through ``display.say``: manifest strings
are untrusted."""

from __future__ import annotations

import argparse
import fnmatch
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.cli.common import (
    EXIT_OK,
    QUARANTINED_HELP,
    load_step_manifest,
    manifest_figures,
    open_root,
    print_json,
    show_progress,
    step_arg,
)
from shardkeeper.core.cli.display import human_size, preview, printable, say, table_lines
from shardkeeper.core.cli.tiers_ls import add_tiers, tiers_cell
from shardkeeper.core.commit.committed import committed_steps, load_manifest, step_dirs
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    StorageError,
    UsageError,
)
from shardkeeper.core.format.layout import LATEST_NAME
from shardkeeper.core.format.logical_member import digests_of
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.lifecycle.quarantine import is_quarantined, load_quarantined
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _latest_hint(storage: Storage) -> int | None:
    try:
        return int(storage.read_bytes(LATEST_NAME).decode().strip())
    except StorageError:
        raise  # the store did not answer (after its retries): the listing would fail the same way
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
    return m.stored()[1]


def cmd_ls(args: argparse.Namespace) -> int:
    storage = open_root(args)
    latest = _latest_hint(storage)
    committed = set(committed_steps(storage))
    rows: list[dict[str, Any]] = []
    dirs = sorted(step_dirs(storage).items())
    bar = make_bar(len(dirs), "ls", show_progress(args), unit="step", leave=False)
    for step, name in dirs:
        bar.update(1)
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
                row["status"] = "other-format"
            except CheckpointError:
                row["status"] = "invalid"  # damaged or deleted since the listing
            else:
                row.update(manifest_figures(m))
        else:
            try:
                names = [n.rstrip("/").rsplit("/", 1)[-1] for n in storage.list_dir(name)]
            except CorruptCheckpointError:  # cannot be listed for what it is: damage
                names = [MANIFEST_NAME]
            row["status"] = (
                "invalid"
                if MANIFEST_NAME in names
                else "quarantined"  # a restore found it damaged and moved its manifest aside
                if any(is_quarantined(n) for n in names)
                else "uncommitted"
            )
        rows.append(row)
    bar.close()
    if args.local:
        add_tiers(rows, args.local)

    if args.json:
        print_json({"root": storage.url, "latest_hint": latest, "steps": rows})
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
            *([tiers_cell(r)] if args.local else []),
        ]
        for r in rows
    ]
    headers = ["STEP", "STATUS", "SIZE", "LEAVES", "WORLD", "CREATED", "", *(["TIERS"] if args.local else [])]
    say(*table_lines(headers, table, "rlrrrll" + ("l" if args.local else "")))
    if latest is not None and latest not in committed:
        say(f"note: the LATEST hint says step {latest}, which is not committed; readers ignore it")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = open_root(args)
    if args.quarantined and args.step is None:
        raise UsageError("inspect --quarantined needs the STEP whose quarantined manifest to show")
    step = _resolve_step(storage, args.step)
    m = load_quarantined(storage, step)[1] if args.quarantined else load_step_manifest(storage, step)
    patterns = args.keys or []
    keys = [k for k in m.leaves if not patterns or any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    if patterns and not keys:
        raise UsageError(f"no key of step {step} matches {' or '.join(patterns)}")

    leaves = _leaf_rows(m, keys)
    if args.json:
        print_json(
            {
                "root": storage.url,
                "step": m.step,
                "format_version": m.format_version,
                "requires": list(m.requires),
                "created_at": m.created_at,
                "attempt": m.attempt,
                "world_size": m.world_size,
                "digest_algorithm": m.digest_algorithm,
                "digest_block_bytes": m.digest_block_bytes,
                "per_rank_prefixes": list(m.per_rank_prefixes),
                "metadata": m.metadata,
                "files": m.stored()[0],
                "size_bytes": _stored_bytes(m),
                "logical_bytes": m.nbytes,
                "leaves": leaves,
            }
        )
        return EXIT_OK
    _say_manifest(storage.url, m, leaves)
    return EXIT_OK


def _leaf_rows(m: Manifest, keys: list[str]) -> list[dict[str, Any]]:
    """What ``inspect`` shows of each of ``keys``: an object's value; a tensor's or bytes'
    dtype, shape, chunks, sizes and logical digest (where recorded)."""
    logical = digests_of(m.logical, m.leaves) or {}  # each tensor's logical digest, where recorded
    leaves = []
    for k in keys:
        leaf = m.leaves[k]
        if leaf.kind == "object":
            leaves.append({"key": k, "kind": "object", "value": leaf.value})
        else:
            leaves.append(
                {
                    "key": k,
                    "kind": leaf.kind,
                    "dtype": leaf.dtype,
                    "shape": list(leaf.shape),
                    "chunks": len(leaf.chunks),
                    "size_bytes": leaf.nbytes,
                    "stored_bytes": sum(c.length for c in leaf.chunks),
                    "logical_digest": logical.get(k),
                }
            )
    return leaves


def _say_manifest(url: str, m: Manifest, leaves: list[dict[str, Any]]) -> None:
    """``inspect``'s text: the manifest's fields and metadata, then a table of ``leaves``."""
    head = [
        ("root", url),
        ("step", m.step),
        ("format version", m.format_version),
        ("requires", ", ".join(m.requires) or "-"),
        ("created at", m.created_at or "-"),
        ("attempt", m.attempt or "-"),
        ("world size", m.world_size),
        ("digest", f"{m.digest_algorithm}, {human_size(m.digest_block_bytes)} blocks"),
        ("files", f"{m.stored()[0]}, {human_size(_stored_bytes(m))}"),
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
            table.append(
                [
                    row["key"],
                    row["kind"],
                    row["dtype"],
                    _shape(row["shape"]),
                    row["chunks"],
                    human_size(row["size_bytes"]),
                    "",
                ]
            )
    say(*table_lines(["KEY", "KIND", "DTYPE", "SHAPE", "CHUNKS", "SIZE", "VALUE"], table, "lllrrrl"))


def add_ls(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``ls ROOT``: every step directory under the root and its state."""
    p = sub.add_parser("ls", parents=[common], help="list checkpoints under ROOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--local",
        action="append",
        metavar="DIR",
        help="a node's local tier directory (repeatable): show which tiers hold each step (docs/tiers.md)",
    )
    p.set_defaults(func=cmd_ls)


def add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``inspect ROOT [STEP]``: one step's manifest, leaf by leaf."""
    p = sub.add_parser("inspect", parents=[common], help="show one checkpoint's metadata and leaves")
    p.add_argument("step", metavar="STEP", nargs="?", type=step_arg, help="the step (default: the newest committed)")
    p.add_argument(
        "--keys", action="append", metavar="PATTERN", help="only keys matching this glob, e.g. 'model/*' (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quarantined", action="store_true", help=QUARANTINED_HELP)
    p.set_defaults(func=cmd_inspect)


__all__ = ["add_inspect", "add_ls", "cmd_inspect", "cmd_ls"]
