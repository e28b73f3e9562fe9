"""`pdserve worker`: start one worker on a model directory."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

ROLES = ("both", "prefill", "decode")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str) -> int:
    """`512MiB`, `2G`, `1000000` -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    binary = "I" in unit
    base = unit[:1] if unit not in ("", "B") else unit
    factor = 1024 ** "KMGT".index(base[0]) * 1024 if binary else _UNITS[base]
    return int(number * factor)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve worker`."""
    parser = subparsers.add_parser(
        "worker", help="serve a model over an OpenAI-compatible HTTP API"
    )
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--role", choices=ROLES, default="both",
        help="both: serve requests alone; decode: also take prompts prefilled by a prefill "
        "worker (header X-Pdserve-Prefill-Url); prefill: only prefill for decode workers",
    )  # fmt: skip
    parser.add_argument("--pool", default="local", help="pool name for metric labels")
    parser.add_argument("--served-model-name", help="model id in the API (default: dir name)")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=512)
    parser.add_argument("--max-num-seqs", type=_positive, default=64)
    parser.add_argument(
        "--no-chunked-prefill", action="store_true",
        help="prefill each prompt in one step (a baseline; ITL suffers)",
    )  # fmt: skip
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=_positive)
    size.add_argument("--kv-cache-memory", type=parse_bytes, metavar="BYTES")
    parser.add_argument("--block-size", type=_positive, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-model-len", type=_positive)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto"
    )
    handoff = parser.add_argument_group("P/D hand-off (roles prefill and decode)")
    handoff.add_argument("--kv-transfer", choices=("nixl", "torch"), default="nixl")
    handoff.add_argument(
        "--transfer-failure-policy", choices=("recompute", "fail"), default="recompute",
        help="decode: on a failed hand-off, prefill here (recompute) or end the request",
    )  # fmt: skip
    handoff.add_argument(
        "--handoff-timeout", type=float, default=30.0, metavar="SECONDS",
        help="lease on KV blocks held for a hand-off; a hand-off not done by then fails",
    )  # fmt: skip
    handoff.add_argument(
        "--kv-transfer-host", help="address peers reach this worker's transfer agent at"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=_positive, help="torch CPU threads (default on CPU: 1)")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Start the worker and serve until interrupted."""
    from pdserve.workers.worker import WorkerOptions, serve

    names = {option.name for option in dataclasses.fields(WorkerOptions)}
    chosen = {k: v for k, v in vars(args).items() if k in names}
    if chosen["kv_cache_dtype"] == "auto":
        chosen["kv_cache_dtype"] = None
    return serve(WorkerOptions(**chosen))
