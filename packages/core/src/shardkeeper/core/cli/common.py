"""What every command of the CLI shares: exit codes, opening ROOT (and catching the usual
mistakes about it), ``--key``, argument types, whether to show progress."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardkeeper.core.cli.roots import check_root
from shardkeeper.core.errors import CheckpointNotFoundError, UsageError
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.storage.object_stores import OBJECT_STORE_PROTOCOLS
from shardkeeper.core.storage.retry import RetryPolicy, with_retries
from shardkeeper.core.util.bars import want_progress

PROG = "shardkeeper"
EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2

KEY_HELP = (
    "the key-encryption key of an encrypted checkpoint: env:VAR (base64 in $VAR) or file:PATH; "
    "with it, data blocks are decrypted and authenticated and the manifest's MAC checked"
)


def print_json(data: Any) -> None:
    """``--json`` output (ASCII escapes: no control character reaches the terminal)."""
    print(json.dumps(data, indent=2, sort_keys=False))


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


#: The CLI's patience with a store that does not answer: up to 8 attempts, backoff capped at
#: 10 s (about 15-35 s in all), each wait announced on stderr (``-o retry_max_attempts=N`` etc.).
CLI_RETRY = RetryPolicy(max_attempts=8, base_delay_s=0.5, max_delay_s=10.0, deadline_s=120.0)
_RETRY_OPTIONS = ("retry_max_attempts", "retry_base_delay_s", "retry_max_delay_s", "retry_deadline_s")


def _retry_policy(options: dict[str, Any]) -> RetryPolicy:
    """``CLI_RETRY`` with the ``-o retry_*`` options (removed from ``options``) applied."""
    given = {name[len("retry_") :]: options.pop(name) for name in _RETRY_OPTIONS if name in options}
    defaults = {f: getattr(CLI_RETRY, f) for f in ("max_attempts", "base_delay_s", "max_delay_s", "deadline_s")}
    try:
        return RetryPolicy(**{**defaults, **given})
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad -o retry_* option: {e}") from None


def open_root(args: argparse.Namespace, *, must_exist: bool = True) -> Storage:
    """The storage of ``args.root`` with the ``-o KEY=VALUE`` options, after ``check_root``
    (a step directory given for a root, a local root that is not there: an error with the
    remedy; a pointer or a folder leading to one root: ``args.root`` becomes that root, and a
    pointer's step ``args.step`` where STEP is optional and not given). Object stores are
    opened with retries that announce themselves (``CLI_RETRY``): the client's own silent
    retries are cut to one attempt."""
    args.root, step = check_root(args.root, getattr(args, "command", None) or "ls", must_exist=must_exist)
    if step is not None and getattr(args, "step", False) is None:
        args.step = step
    options = dict(_parse_option(o) for o in args.storage_option or ())
    policy = _retry_policy(options)
    remote = args.root.split("://", 1)[0] in OBJECT_STORE_PROTOCOLS if "://" in args.root else False
    if remote:
        options.setdefault("client_retries", 1)
    try:
        storage = open_storage(args.root, **options)
    except TypeError as e:
        raise UsageError(f"bad --storage-option for {args.root}: {e}") from None
    except ImportError as e:
        raise UsageError(
            f"cannot open {args.root}: {e}; install the backend's extra, e.g. "
            f"`pip install 'shardkeeper-core[s3]'` or `'shardkeeper-core[gcs]'`"
        ) from None
    if not remote:
        return storage
    storage = with_retries(storage, policy)
    if must_exist:
        _check_bucket(storage, args.root)
    return storage


def _check_bucket(storage: Storage, root: str) -> None:
    """An object-store root whose bucket is missing is an error (exit 2), as a missing local
    root is: a prefix holds nothing until written, but a bucket is there or not, and a typo
    in its name would otherwise list "no checkpoints" and exit 0."""
    ask = getattr(storage, "bucket_exists", None)  # (FsspecStorage's, through any wrapper)
    if ask is not None and ask() is False:
        scheme, _, path = root.partition("://")
        bucket = path.split("/", 1)[0]
        raise CheckpointNotFoundError(
            f"no such bucket: {scheme}://{bucket} (root {root}); check its name, the endpoint "
            f"(-o endpoint_url=...) and the credentials' account"
        )


def show_progress(args: argparse.Namespace) -> bool:
    """Whether this command shows progress bars (``core/util/bars.py``: stderr, terminals only
    unless ``--progress``; never with ``--no-progress``, and by default not with ``--json``
    or ``--quiet``)."""
    return want_progress(getattr(args, "progress", None), json=getattr(args, "json", False), quiet=args.quiet)


def with_key(storage: Storage, spec: str | None, encryption_root: str | None = None) -> Storage:
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


def add_key_options(p: argparse.ArgumentParser) -> None:
    """``--key`` and ``--encryption-root``, for the commands that read encrypted data."""
    p.add_argument("--key", metavar="SPEC", help=KEY_HELP)
    p.add_argument(
        "--encryption-root",
        metavar="ROOT",
        help="the root an encrypted checkpoint was "
        "written under, when it was moved or copied since (default: ROOT itself)",
    )


def step_arg(text: str) -> int:
    """argparse type of STEP: a non-negative integer."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"STEP must be a non-negative integer, got {text!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"STEP must be a non-negative integer, got {text!r}")
    return step


QUARANTINED_HELP = (
    "the step's quarantined manifest (a damaged step a restore moved aside, until gc removes it) "
    "instead of its committed one"
)


def load_step_manifest(storage: Storage, step: int) -> Manifest:
    """``step``'s manifest (``commit.load_manifest``); a step that is not committed but was
    quarantined says so, and how to look at it."""
    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.lifecycle.quarantine import quarantined_manifests

    try:
        return load_manifest(storage, step)
    except CheckpointNotFoundError as e:
        aside = quarantined_manifests(storage, step)
        if not aside:
            raise
        raise CheckpointNotFoundError(
            f"{e}. A restore found step {step} damaged and quarantined it: its manifest is at "
            f"{storage.describe(aside[-1])} (add --quarantined to look at it; gc removes it)"
        ) from None


def manifest_figures(m: Manifest) -> dict[str, Any]:
    """A step's figures in ``ls``: its stored and logical bytes, leaves, world size, time."""
    return {
        "size_bytes": m.stored()[1],
        "logical_bytes": m.nbytes,
        "leaves": len(m.leaves),
        "world_size": m.world_size,
        "created_at": m.created_at or None,
    }


__all__ = [
    "CLI_RETRY",
    "EXIT_DAMAGED",
    "EXIT_OK",
    "EXIT_USAGE",
    "KEY_HELP",
    "PROG",
    "QUARANTINED_HELP",
    "add_key_options",
    "load_step_manifest",
    "manifest_figures",
    "open_root",
    "print_json",
    "show_progress",
    "step_arg",
    "with_key",
]
