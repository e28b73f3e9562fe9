"""`pdserve demo`: the first thing a new user runs. Creates the tiny model (once),
starts a worker on it, drives a mixed workload and prints the latency report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "models" / "tiny-llama"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve demo`."""
    parser = subparsers.add_parser(
        "demo", help="serve the tiny model locally, drive a mixed workload, print the report"
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--workload", default="mixed", choices=("chat", "rag", "long", "mixed"))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="report folder")
    parser.add_argument(
        "--worker-arg", action="append", default=[], metavar="ARG",
        help="extra argument for the worker, e.g. --worker-arg=--no-chunked-prefill",
    )  # fmt: skip
    parser.set_defaults(handler=run)


def ensure_tiny_model(model_dir: Path) -> None:
    """Write the default tiny model unless it is already there."""
    from pdserve.workers.engine.checkpoint import TinyModelSpec, write_tiny_checkpoint

    if (model_dir / "config.json").is_file():
        return
    print(f"writing the tiny model to {model_dir}")
    write_tiny_checkpoint(model_dir, TinyModelSpec())


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when the workload was served."""
    from pdserve.workers.bench.config import BenchConfig
    from pdserve.workers.bench.metrics import SLO
    from pdserve.workers.bench.report import format_report, write_json, write_plot
    from pdserve.workers.bench.runner import run_benchmark
    from pdserve.workers.engine.config import ModelConfig
    from pdserve.workers.server.process import running_worker

    ensure_tiny_model(args.model_dir)
    vocab = ModelConfig.from_dir(args.model_dir).vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "worker.log"
    print(f"starting a worker on {args.model_dir} (log: {log_path})")
    with running_worker(args.model_dir, log_path, args.worker_arg) as worker:
        print(f"worker ready at {worker.url}; {args.duration:.0f}s of {args.workload} traffic")
        config = BenchConfig(
            url=worker.url,
            workload=args.workload,
            rate=args.rate,
            duration_s=args.duration,
            vocab_size=vocab,
            slo=SLO(ttft_ms=2000.0, tpot_ms=200.0, itl_ms=None, e2e_ms=None),
        )
        result = run_benchmark(config)
    print(format_report(result))
    write_json(result, args.out / "report.json")
    write_plot(result, args.out / "report.png")
    print(f"wrote {args.out / 'report.json'} and {args.out / 'report.png'}")
    overall = result.metrics.overall
    if overall.requests == 0 or overall.succeeded == 0:
        print("pdserve demo: no request succeeded", file=sys.stderr)
        return 1
    return 0
