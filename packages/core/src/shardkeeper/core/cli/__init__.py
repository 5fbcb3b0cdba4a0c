"""The ``shardkeeper`` command: ls, inspect, verify, keys, gc, delete, export, import and advise.

Runs without torch, so an operator can look after a bucket from any machine::

    shardkeeper ls s3://bucket/run-42
    shardkeeper inspect /data/run 1200 --keys 'model/*'
    shardkeeper verify /data/run            # exit 0 clean, 1 damaged, 2 usage / nothing there
    shardkeeper keys /data/run              # the key ids each committed step needs (key rotation)
    shardkeeper gc /data/run --dry-run
    shardkeeper delete /data/run 1200 --damaged         # verified damaged: deleted, the newest too
    shardkeeper export /data/run 1200 --to ./hf-model      # Hugging Face safetensors + index
    shardkeeper --version
    shardkeeper import ./dcp-ckpt /data/run --step 1200 --trust-pickle
    shardkeeper advise /data/run --mtbf 3h --interval 30m   # Young/Daly checkpoint interval

Exit codes: 0 success; 1 damage found (verify) or a removal failed (gc, delete); 2 usage error, no
checkpoint where one was asked for, a missing extra, or any other error (one line on stderr,
no traceback). Results go to stdout; progress bars, notices ("waiting for s3://...") and
errors to stderr.

This module is the entry point (``main``: the parser, logging, the exit status of an error);
each command lives in the module of its group: ``view`` (ls, inspect), ``check`` (verify, gc, delete),
``keys``, ``convert`` (export, import), ``advise``; ``common`` holds what they share, ``roots`` the
mistakes about ROOT it catches, ``tiers_ls`` what ``ls`` shows of a root's local tiers,
``display`` how a person is shown untrusted text.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.cli import advise, check, convert, keys, view
from shardkeeper.core.cli.common import EXIT_OK, EXIT_USAGE, PROG
from shardkeeper.core.cli.display import PrintableFormatter, say
from shardkeeper.core.errors import CheckpointError, UsageError
from shardkeeper.core.format.features import FORMAT_VERSION
from shardkeeper.core.storage.retry import wait_log
from shardkeeper.core.util.bars import BarSafeHandler
from shardkeeper.core.util.extras import EXTRA_OF, install_hint
from shardkeeper.core.util.version import shardkeeper_version


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
    common.add_argument(
        "-v", "--verbose", action="store_true", help="log what is done to stderr (verify: each step's result and time)"
    )
    common.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars or waiting notices on stderr (errors still show)"
    )
    bars = common.add_mutually_exclusive_group()
    bars.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="progress bars on stderr (default: when stderr is a terminal, and not with --json or --quiet)",
    )
    bars.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    parser = argparse.ArgumentParser(prog=PROG, description="Inspect, verify and clean shardkeeper checkpoint roots.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # The order of `shardkeeper --help`.
    for add in (
        view.add_ls,
        view.add_inspect,
        check.add_verify,
        keys.add_keys,
        check.add_gc,
        check.add_delete,
        convert.add_export,
        advise.add_advise,
        convert.add_import,
    ):
        add(sub, common)
    return parser


def version_line() -> str:
    """``shardkeeper 0.1.0 (checkpoint format 1)``: the core's release and the format version
    it writes and reads."""
    return f"{PROG} {shardkeeper_version()} (checkpoint format {FORMAT_VERSION})"


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
    # Log records and warnings reach stderr escaped, like every other line (display.say), and
    # without tearing a progress bar (BarSafeHandler).
    handler = BarSafeHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if args.verbose else logging.ERROR)
    # What a storage call is waiting for (storage/retry.py's wait_log): shown unless --quiet.
    waiting = BarSafeHandler(sys.stderr)
    waiting.setFormatter(PrintableFormatter(f"{PROG}: %(message)s, Ctrl-C to stop"))
    wait_level, wait_propagate = wait_log.level, wait_log.propagate
    wait_log.addHandler(waiting)
    wait_log.setLevel(logging.ERROR if args.quiet else logging.INFO)
    wait_log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _run(args)
    finally:
        wait_log.removeHandler(waiting)
        wait_log.setLevel(wait_level)
        wait_log.propagate = wait_propagate
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
    except ModuleNotFoundError as e:
        # A torch-free install running a command (or reading a codec) that needs an extra.
        name = (e.name or "").split(".")[0]
        if args.debug:
            raise
        if name not in EXTRA_OF:
            return _internal_error(e)
        say(f"{PROG}: error: {PROG} {args.command} needs {name}: {install_hint(name)}", file=sys.stderr)
        return EXIT_USAGE
    except (UsageError, CheckpointError, OSError, ValueError) as e:
        if args.debug:
            raise
        say(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - a bug still gets one line; --debug shows it
        if args.debug:
            raise
        return _internal_error(e)


def _internal_error(e: BaseException) -> int:
    say(f"{PROG}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
    return EXIT_USAGE


__all__ = ["build_parser", "main", "version_line"]
