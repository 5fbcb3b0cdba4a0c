"""Commands that look after a root: ``verify`` (every file, size and digest; exit 1 on damage),
``gc`` (leftovers of failed saves, never a commit in progress) and ``delete`` (one step, by
retention's rules; ``--damaged``: a step verification finds damaged, the newest included)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardkeeper.core.cli.common import (
    EXIT_DAMAGED,
    EXIT_OK,
    PROG,
    QUARANTINED_HELP,
    add_key_options,
    load_step_manifest,
    open_root,
    print_json,
    show_progress,
    step_arg,
    with_key,
)
from shardkeeper.core.cli.display import human_size, say
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UsageError
from shardkeeper.core.lifecycle.gc import DEFAULT_GC_MIN_AGE_S, collect_garbage
from shardkeeper.core.lifecycle.quarantine import load_quarantined
from shardkeeper.core.runtime.binding import NODE_TOKEN
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar
from shardkeeper.core.verify.report import Problem, RootVerifyReport


def _print_problems(problems: Sequence[Problem]) -> None:
    for p in problems:
        say(f"  - {p.message}")


def cmd_verify(args: argparse.Namespace) -> int:
    from shardkeeper.core.verify.root import verify_root
    from shardkeeper.core.verify.step import stored_bytes, verify_step  # numpy (the chunk reader)

    storage = with_key(open_root(args), args.key, args.encryption_root)
    here_only = _node_directory(storage)
    if args.quarantined and args.step is None:
        raise UsageError("verify --quarantined needs the STEP whose quarantined manifest to check")
    if args.step is not None:
        try:
            m = load_quarantined(storage, args.step)[1] if args.quarantined else load_step_manifest(storage, args.step)
            bar = make_bar(stored_bytes(m), f"verify step {args.step}", show_progress(args))
            try:
                reports = [
                    verify_step(
                        storage, args.step, manifest=m, on_bytes=bar.update, logical=args.logical, here_only=here_only
                    )
                ]
            finally:
                bar.close()
        except CorruptCheckpointError as e:
            # The manifest exists but does not validate: that is damage, not a usage error.
            root = RootVerifyReport(
                root=storage.url,
                problems=[
                    Problem(
                        step=args.step,
                        kind="manifest",
                        file="",
                        message=f"step {args.step}: the {'quarantined ' if args.quarantined else ''}manifest does "
                        f"not validate: {e}",
                    )
                ],
            )
        else:
            root = RootVerifyReport(root=storage.url, steps=reports)
    else:
        root = verify_root(storage, progress=show_progress(args), logical=args.logical, here_only=here_only)
        if not root.steps and not root.problems:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")

    if args.json:
        print_json(root.to_json())
        return EXIT_OK if root.ok else EXIT_DAMAGED

    for p in root.problems:
        say(p.message)
    _print_steps(root, storage.url)
    bad = len(root.all_problems)
    if bad:
        keyed = sum(p.kind == "key" for p in root.all_problems)
        more = f" ({keyed} of them a key the key given does not hold, not damage)" if keyed else ""
        say(f"verify: {bad} problem(s) under {storage.url}{more}", file=sys.stderr)
        return EXIT_DAMAGED
    if root.all_warnings:
        say(f"verify: no damage under {storage.url}; {len(root.all_warnings)} warning(s)", file=sys.stderr)
    return EXIT_OK


def _print_steps(root: RootVerifyReport, url: str) -> None:
    """Each step's verdict, its problems and its warnings (``verify`` without ``--json``)."""
    if any(r.elsewhere for r in root.steps):
        say(
            f"{url} is a node's directory of a local tier: it holds its own ranks' files and the copies or "
            f"parity other nodes sent it, so a step's files that are not here are listed, not checked (`{PROG} ls "
            f"ROOT --local DIR ...` over every node's directory says whether each step is whole or rebuildable)"
        )
    for r in root.steps:
        tally = f"; {r.logical}" if r.logical is not None else ""
        if r.elsewhere:
            tally += f"; {len(r.elsewhere)} file(s) not on this node"

        warned = f", with {len(r.warnings)} warning(s)" if r.warnings else ""
        if r.ok and r.structure_only:
            say(
                f"step {r.step}: structure OK ({r.files_checked} files{tally}); encrypted, and read without the key, "
                f"so no byte was checked: pass --key (and --encryption-root ROOT for a node's local tier) to check them"
            )
        elif r.ok:
            say(
                f"step {r.step}: OK{warned} ({r.files_checked} files, {r.chunks_checked} chunks, "
                f"{human_size(r.bytes_checked)} checked in {r.seconds:.2f} s{tally})"
            )
        elif all(p.kind == "key" for p in r.problems):
            say(f"step {r.step}: NOT CHECKED: it needs a key the key given does not hold (`{PROG} keys ROOT`)")
            _print_problems(r.problems)
        else:
            say(f"step {r.step}: DAMAGED ({len(r.problems)} problem(s){tally}{warned})")
            _print_problems(r.problems)
        for w in r.warnings:  # readable, not damaged: no exit status of their own
            say(f"  - warning: {w.message}")


def _node_directory(storage: Storage) -> bool:
    """Whether ``storage`` is a node's directory of a local tier (docs/tiers.md), whose steps
    lack the files other nodes hold."""
    try:
        return storage.exists(NODE_TOKEN)
    except CheckpointError:
        return False  # (the listing of the steps says what is wrong with the root)


def cmd_gc(args: argparse.Namespace) -> int:
    storage = open_root(args)
    if args.min_age_s < 0:
        raise UsageError(f"--min-age-s must be >= 0, got {args.min_age_s}")
    report = collect_garbage(storage, min_age_s=args.min_age_s, dry_run=args.dry_run, progress=show_progress(args))
    if args.json:
        print_json(report.to_json())
        return EXIT_DAMAGED if report.errors else EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for p in report.removed_paths:
        say(f"{verb} {storage.describe(p)}")
    for p in report.skipped_young:
        say(f"kept {storage.describe(p)} (younger than {args.min_age_s:g} s: a save may be running)")
    if report.kept_referenced:
        say(f"kept {len(report.kept_referenced)} file(s) of deleted steps that committed steps reference")
    for p in report.kept_in_flight:
        say(f"kept {storage.describe(p)} (a commit in progress needs it)")
    for e in report.errors:
        say(f"{PROG}: error: {e}", file=sys.stderr)
    n = len(report.removed_paths)
    say(f"gc: {verb} {n} path(s), {human_size(report.removed_bytes)}" + (" (dry run)" if args.dry_run else ""))
    return EXIT_DAMAGED if report.errors else EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    from shardkeeper.core.commit.committed import committed_steps, manifest_steps
    from shardkeeper.core.lifecycle.retention import DeleteOnly, apply_retention

    storage = with_key(open_root(args), args.key, args.encryption_root)
    step, url = args.step, storage.url
    if args.damaged:
        from shardkeeper.core.lifecycle.delete_damaged import delete_damaged  # numpy (the chunk reader)

        found = delete_damaged(storage, step)
        if args.json:
            print_json({"step": step, "deleted": True, "damaged": True, "damage": found.damage})
            return EXIT_OK
        say(f"deleted damaged step {step} under {url}:")
        for line in found.damage:
            say(f"  - {line}")
        return EXIT_OK
    if step not in manifest_steps(storage):
        raise CheckpointNotFoundError(f"step {step} under {url} has no manifest: nothing to delete")
    steps = committed_steps(storage)
    if step not in steps:
        raise UsageError(
            f"step {step} under {url} has a manifest that does not validate; `{PROG} verify {url} {step}` names "
            f"the damage, and `{PROG} delete {url} {step} --damaged` deletes it (with --key for an encrypted root)"
        )
    if step == steps[-1]:
        raise UsageError(
            f"step {step} is the newest committed step under {url}: a resume goes back to it, so it is never "
            f"deleted by retention's rules. If it is damaged, `{PROG} delete {url} {step} --damaged` verifies and "
            f"deletes it (with --key for an encrypted root)"
        )
    gone = step in apply_retention(storage, DeleteOnly(frozenset([step])))
    if args.json:
        print_json({"step": step, "deleted": gone, "damaged": False, "damage": []})
    elif gone:
        say(f"deleted step {step} under {url} (files that other steps reference were kept)")
    else:
        say(f"{PROG}: step {step} under {url} was kept: see the log above (-v) for why", file=sys.stderr)
    return EXIT_OK if gone else EXIT_DAMAGED


def add_delete(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``delete ROOT STEP [--damaged]``."""
    p = sub.add_parser(
        "delete",
        parents=[common],
        help="delete one step (never the newest); --damaged: a step verify finds damaged, the newest too",
    )
    p.add_argument("step", metavar="STEP", type=step_arg, help="the step to delete")
    p.add_argument(
        "--damaged",
        action="store_true",
        help="verify the step first (every file and digest) and delete it, the newest included, only if it is "
        "damaged; an intact step is refused",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_key_options(p)
    p.set_defaults(func=cmd_delete)


def add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``verify ROOT [STEP]``: exit 0 clean (warnings included), 1 damaged."""
    p = sub.add_parser("verify", parents=[common], help="check files, sizes and every digest; exit 1 on damage")
    p.add_argument("step", metavar="STEP", nargs="?", type=step_arg, help="the step (default: every committed step)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quarantined", action="store_true", help=QUARANTINED_HELP)
    p.add_argument(
        "--logical",
        action="store_true",
        help="also recompute each tensor's logical digest from its stored chunks and compare it with the one "
        "the save recorded (chunks that pass their digests but do not form the saved tensor: a writer bug); "
        "costs a full pass over the data: every byte read is summed and every compressed chunk decoded",
    )
    add_key_options(p)
    p.set_defaults(func=cmd_verify)


def add_gc(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``gc ROOT``: remove what failed saves left behind."""
    p = sub.add_parser("gc", parents=[common], help="remove leftovers of failed saves and unreferenced files")
    p.add_argument(
        "--min-age-s",
        type=float,
        default=DEFAULT_GC_MIN_AGE_S,
        metavar="N",
        help=f"only remove leftovers older than N seconds (default "
        f"{DEFAULT_GC_MIN_AGE_S:g}); must exceed the longest save",
    )
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)


__all__ = ["add_delete", "add_gc", "add_verify", "cmd_delete", "cmd_gc", "cmd_verify"]
