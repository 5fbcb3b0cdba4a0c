"""Commands that move checkpoints between formats: ``export`` (a step as Hugging Face
safetensors shards + index) and ``import`` (a torch.distributed.checkpoint directory, or a
Hugging Face safetensors folder, as a committed step). Both load their module on use:
``import`` needs torch, the CLI does not."""

from __future__ import annotations

import argparse
import os

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
    from shardkeeper.core.tools.export import export_safetensors  # numpy: the [torch] extra

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


def is_safetensors_folder(source: str) -> bool:
    """Whether ``import`` reads ``source`` as a Hugging Face safetensors folder: by its contents
    (``model.safetensors`` or its index; a Hub cache repository folder; transformers' legacy
    ``pytorch_model.bin``, which the folder reader refuses by name), never when it holds a DCP
    ``.metadata``. A URL is one (DCP directories are local)."""
    if "://" in source and not source.startswith("file://"):
        return True
    path = source.removeprefix("file://")
    if os.path.isfile(os.path.join(path, ".metadata")):
        return False
    from shardkeeper.core.hf.folder import INDEX_NAME, PICKLED_NAMES, SINGLE_NAME  # no torch

    names = (SINGLE_NAME, INDEX_NAME, *PICKLED_NAMES)
    return any(os.path.isfile(os.path.join(path, n)) for n in names) or os.path.isdir(os.path.join(path, "snapshots"))


def cmd_import(args: argparse.Namespace) -> int:
    storage = open_root(args, must_exist=False)  # the root is created
    if is_safetensors_folder(args.source):
        from shardkeeper.core.hf.importer import import_hf  # torch: the [torch] extra

        m = import_hf(args.source, storage, step=args.step, prefix=args.prefix, progress=show_progress(args))
        kind = "the safetensors folder "
    else:
        from shardkeeper.core.tools.dcp_import import import_dcp  # torch: the [torch] extra

        m = import_dcp(
            args.source, storage, step=args.step, trust_pickle=args.trust_pickle, progress=show_progress(args)
        )
        kind = ""
    say(
        f"imported {kind}{args.source} as step {m.step} under {storage.url}: {len(m.leaves)} leaves, "
        f"{human_size(m.nbytes)}"
    )
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
    """``import DCP_DIR ROOT --step N --trust-pickle``, ``import HF_DIR ROOT --step N``."""
    imp = argparse.ArgumentParser(add_help=False)
    imp.add_argument(
        "source",
        metavar="SOURCE",
        help="a torch.distributed.checkpoint directory, or a Hugging Face safetensors folder (model.safetensors "
        "or its index; told by its contents)",
    )
    p = sub.add_parser(
        "import",
        parents=[imp, common],
        help="write a torch.distributed.checkpoint directory or a safetensors folder as a committed step",
    )
    p.add_argument("--step", type=step_arg, required=True, metavar="N", help="the step to commit")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="required for a DCP directory: its .metadata is a pickle, which can run code; pass it only for "
        "checkpoints you trust (a safetensors folder holds no pickle and needs none)",
    )
    p.add_argument(
        "--prefix",
        default="model/",
        metavar="PREFIX",
        help="a safetensors folder's tensors become PREFIX<name> (default model/, which restore({'model': model}) fills)",
    )
    p.set_defaults(func=cmd_import)


__all__ = ["add_export", "add_import", "cmd_export", "cmd_import"]
