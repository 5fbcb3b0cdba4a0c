"""``shardkeeper keys ROOT``: the key ids the committed steps of an encrypted root need (each
step's manifest and every data file it lists or references), so an operator knows when a key
rotated out may be retired. Needs no key: read from manifests and file headers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardkeeper.core.cli.common import EXIT_DAMAGED, EXIT_OK, PROG, open_root, print_json
from shardkeeper.core.cli.display import say
from shardkeeper.core.codec.key_usage import keys_needed


def step_ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7`` (consecutive committed steps, not step numbers: ``10, 20``
    stay apart)."""
    out: list[str] = []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


def cmd_keys(args: argparse.Namespace) -> int:
    storage = open_root(args)
    usage = keys_needed(storage)
    if args.json:
        print_json(usage.to_json())
        return EXIT_DAMAGED if usage.unknown else EXIT_OK
    by_key = usage.steps_of()
    files: dict[str, int] = {}
    for key in usage.file_keys.values():
        files[key] = files.get(key, 0) + 1
    for key, steps in by_key.items():
        word = "step" if len(steps) == 1 else "steps"
        say(f"{key}  needed by {word} {step_ranges(steps)} ({files.get(key, 0)} data file(s) sealed under it)")
    plain = [s.step for s in usage.steps if s.manifest_key is None]
    if plain:
        say(f"not encrypted (no key needed): steps {step_ranges(plain)}")
    if not usage.steps and not usage.unknown:
        say(f"no checkpoints under {storage.url}")
    for _, _, why in usage.unknown:
        say(f"{PROG}: cannot tell: {why}", file=sys.stderr)
    if usage.unknown:
        say(
            f"keys: {len(usage.unknown)} manifest(s) or file(s) could not be read, so the list may be incomplete: "
            f"retire no key on its word",
            file=sys.stderr,
        )
        return EXIT_DAMAGED
    if len(by_key) > 1:
        say(
            "a key may be retired once no committed step needs it: after retention (or `shardkeeper delete`) has "
            "removed the steps listed for it; saves after a rotation reference no file of the old key"
        )
    return EXIT_OK


def add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``keys ROOT``: the key ids each committed step needs."""
    p = sub.add_parser(
        "keys",
        parents=[common],
        help="list the key ids the committed steps of an encrypted root need (when an old key may be retired)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_keys)


__all__ = ["add_keys", "cmd_keys", "step_ranges"]
