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

This module is the entry point (``main``: the parser, logging, the exit status of an error);
each command lives in the module of its group: ``view`` (ls, inspect), ``check`` (verify, gc),
``convert`` (export, import), ``advise``; ``common`` holds what they share, ``display`` how a
person is shown untrusted text.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.cli import advise, check, convert, view
from shardkeeper.core.cli.common import EXIT_OK, EXIT_USAGE, PROG
from shardkeeper.core.cli.display import PrintableFormatter, say
from shardkeeper.core.errors import CheckpointError, UsageError


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("root", metavar="ROOT", help="checkpoint root: a path or an fsspec URL")
    common.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="passed to the storage backend (repeatable); VALUE is parsed as JSON when it can be, "
        'e.g. -o anon=true -o \'client_kwargs={"endpoint_url": "http://minio:9000"}\'',
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    parser = argparse.ArgumentParser(prog=PROG, description="Inspect, verify and clean shardkeeper checkpoint roots.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # The order of `shardkeeper --help`.
    for add in (
        view.add_ls,
        view.add_inspect,
        check.add_verify,
        check.add_gc,
        convert.add_export,
        advise.add_advise,
        convert.add_import,
    ):
        add(sub, common)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
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
        say(f"{PROG}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["build_parser", "main"]
