"""`pdserve model init`: generate a random tiny Llama checkpoint.

The checkpoint module imports torch and tokenizers only when a model is written, so
`pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint

# One flag per spec field (--kv-heads for kv_heads), with the spec's defaults.
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TinyModelSpec)}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `model` command and its `init` subcommand."""
    model = subparsers.add_parser("model", help="create model checkpoints")
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="write a random tiny Llama checkpoint with its tokenizer",
        description="Write a Llama-architecture checkpoint with random weights and a "
        "byte-level BPE tokenizer, in Hugging Face format, to DIR.",
    )
    init.add_argument("directory", type=Path, metavar="DIR", help="where to write the model")
    init.add_argument(
        "--tiny", action="store_true", help="generate a random tiny model (required for now)"
    )
    init.add_argument("--force", action="store_true", help="replace DIR if it is not empty")
    for name, default in _DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        init.add_argument(flag, type=int, default=default, help=f"(default: {default})")
    init.set_defaults(handler=_init)


def _fail(message: str) -> int:
    print(f"pdserve model init: error: {message}", file=sys.stderr)
    return 2


def _init(args: argparse.Namespace) -> int:
    if not args.tiny:
        return _fail("only random tiny models can be generated: pass --tiny")
    directory: Path = args.directory
    if directory.is_dir() and any(directory.iterdir()) and not args.force:
        return _fail(f"{directory} exists and is not empty (use --force to replace it)")
    try:
        spec = TinyModelSpec(**{name: getattr(args, name) for name in _DEFAULTS})
        write_tiny_checkpoint(directory, spec, overwrite=args.force)
    except (ValueError, FileExistsError) as error:
        return _fail(str(error))
    print(directory)
    print(f"parameters: {spec.parameter_count():,}")
    return 0
