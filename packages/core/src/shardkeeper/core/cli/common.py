"""What every command of the CLI shares: exit codes, opening ROOT, ``--key``, argument types."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardkeeper.core.errors import UsageError
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage

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


def open_root(args: argparse.Namespace) -> Storage:
    """The storage of ``args.root`` with the ``-o KEY=VALUE`` options."""
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


__all__ = [
    "EXIT_DAMAGED",
    "EXIT_OK",
    "EXIT_USAGE",
    "KEY_HELP",
    "PROG",
    "add_key_options",
    "open_root",
    "print_json",
    "step_arg",
    "with_key",
]
