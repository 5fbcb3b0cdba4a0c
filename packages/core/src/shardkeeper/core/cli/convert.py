"""Commands that move checkpoints between formats: ``export`` (a step as Hugging Face
safetensors shards + index) and ``import`` (a torch.distributed.checkpoint directory as a
committed step). Both load their module on use: ``import`` needs torch, the CLI does not."""

from __future__ import annotations

import argparse

from shardkeeper.core.cli.common import (
    EXIT_OK,
    add_key_options,
    open_root,
    print_json,
    show_progress,
    step_arg,
    with_key,
)
from shardkeeper.core.cli.display import human_size, say


def cmd_export(args: argparse.Namespace) -> int:
    from shardkeeper.core.export import export_safetensors  # numpy: the [torch] extra

    storage = with_key(open_root(args), args.key, args.encryption_root)
    res = export_safetensors(
        storage,
        args.step,
        to=args.to,
        keys=args.keys or ["model/*"],
        keep_prefix=args.keep_prefix,
        max_shard_size=args.max_shard_size,
        progress=show_progress(args),
        overwrite=args.overwrite,
    )
    if args.json:
        print_json(res.to_json())
        return EXIT_OK
    if res.removed:
        say(f"removed {len(res.removed)} file(s) of an earlier export from {res.directory}")
    say(
        f"exported step {res.step}: {len(res.weight_map)} tensors, {human_size(res.total_size)} in "
        f"{len(res.files)} file(s) to {res.directory} (index: {res.index_path})"
    )
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from shardkeeper.core.dcp_import import import_dcp  # torch: the [torch] extra

    storage = open_root(args, must_exist=False)  # the root is created
    m = import_dcp(args.source, storage, step=args.step, trust_pickle=args.trust_pickle, progress=show_progress(args))
    say(f"imported {args.source} as step {m.step} under {storage.url}: {len(m.leaves)} leaves, {human_size(m.nbytes)}")
    return EXIT_OK


def add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``export ROOT [STEP] --to DIR``."""
    p = sub.add_parser("export", parents=[common], help="write a step as Hugging Face safetensors shards + index")
    p.add_argument("step", metavar="STEP", nargs="?", type=step_arg, help="the step (default: the newest committed)")
    p.add_argument(
        "--to", required=True, metavar="DIR", help="output directory (local; new or empty, unless --overwrite)"
    )
    p.add_argument(
        "--keys", action="append", metavar="PATTERN", help="tensor keys to export (glob, repeatable; default 'model/*')"
    )
    p.add_argument("--keep-prefix", action="store_true", help="keep the 'model/' prefix in the exported names")
    p.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest shard file, e.g. 5GB, 500MB (default 5GB)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="export into a folder that is not empty: first remove the *.safetensors files and indexes there "
        "(an earlier export's; other files are kept)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    add_key_options(p)
    p.set_defaults(func=cmd_export)


def add_import(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``import DCP_DIR ROOT --step N --trust-pickle``."""
    imp = argparse.ArgumentParser(add_help=False)
    imp.add_argument("source", metavar="DCP_DIR", help="a torch.distributed.checkpoint directory")
    p = sub.add_parser(
        "import", parents=[imp, common], help="write a torch.distributed.checkpoint directory as a committed step"
    )
    p.add_argument("--step", type=step_arg, required=True, metavar="N", help="the step to commit")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="required: DCP's .metadata is a pickle, which can run code; pass it only for checkpoints you trust",
    )
    p.set_defaults(func=cmd_import)


__all__ = ["add_export", "add_import", "cmd_export", "cmd_import"]
