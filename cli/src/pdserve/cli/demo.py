"""`pdserve demo`: the first thing a new user runs. Creates the tiny model (once), runs
a local pool (one prefill and one decode worker behind the router, as `pdserve local`
does), drives a mixed workload whose long prompts cross the routing table's bucket
boundary, and prints the latency report per bucket and per mode served."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "models" / "tiny-llama"
# Prompts up to this many tokens are served colocated, longer ones disaggregated.
BUCKET_BOUNDARY = 512


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve demo`."""
    parser = subparsers.add_parser(
        "demo",
        help="serve the tiny model with a local P/D pool, drive a mixed workload, print the report",
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--workload", default="mixed", choices=("chat", "rag", "long", "mixed"))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="report folder")
    parser.set_defaults(handler=run)


def ensure_tiny_model(model_dir: Path) -> None:
    """Write the default tiny model unless it is already there."""
    from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint

    if (model_dir / "config.json").is_file():
        return
    print(f"writing the tiny model to {model_dir}")
    write_tiny_checkpoint(model_dir, TinyModelSpec())


def demo_pool(model_dir: Path) -> dict[str, Any]:
    """The demo's ServingPool (deploy/examples/tiny-disaggregated.yaml, serving the
    model at `model_dir`)."""
    return {
        "apiVersion": "pdserve.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "tiny-pd"},
        "spec": {
            "model": {
                "name": "tiny-llama",
                "path": str(model_dir),
                "dtype": "float32",
                "maxModelLen": 4096,
            },
            "image": "pdserve:0.1.0",
            "prefill": {
                "replicas": 1,
                "engine": {"maxNumBatchedTokens": 512, "maxNumSeqs": 8, "numKvBlocks": 1024},
            },
            "decode": {
                "replicas": 1,
                "engine": {"maxNumBatchedTokens": 128, "maxNumSeqs": 32, "numKvBlocks": 2048},
            },
            "kvTransfer": {"backend": "nixl", "failurePolicy": "recompute"},
            "routing": {
                "buckets": [
                    {"maxInputTokens": BUCKET_BOUNDARY, "mode": "colocated"},
                    {"mode": "disaggregated"},
                ]
            },
            "slo": {"ttft": {"seconds": 2.0}, "itl": {"seconds": 0.2}},
        },
    }


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when the workload was served."""
    try:
        import yaml

        from pdserve.operator import api
        from pdserve.operator.local.pool import LocalPool
    except ModuleNotFoundError as error:
        print(f"pdserve demo: needs the pdserve-operator package ({error})", file=sys.stderr)
        return 2
    ensure_tiny_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = demo_pool(args.model_dir)
    (args.out / "pool.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    run_dir = args.out / "pool"
    print(f"starting pool {manifest['metadata']['name']} (logs in {run_dir / 'logs'})")
    with LocalPool(api.parse_pool(manifest), run_dir) as pool:
        print(
            f"router at {pool.url}: prompts up to {BUCKET_BOUNDARY} tokens colocated, longer "
            f"ones disaggregated; {args.duration:.0f}s of {args.workload} traffic"
        )
        result = _drive(pool.url, args)
    return _report(result, args.out)


def _drive(url: str, args: argparse.Namespace) -> Any:
    from pdserve.workers.bench.config import BenchConfig
    from pdserve.workers.bench.metrics import SLO
    from pdserve.workers.bench.runner import run_benchmark
    from pdserve.workers.engine.config import ModelConfig

    config = BenchConfig(
        url=url,
        workload=args.workload,
        rate=args.rate,
        duration_s=args.duration,
        vocab_size=ModelConfig.from_dir(args.model_dir).vocab_size,
        slo=SLO(ttft_ms=2000.0, tpot_ms=200.0, itl_ms=None, e2e_ms=None),
        buckets=(BUCKET_BOUNDARY,),
    )
    return run_benchmark(config)


def _report(result: Any, out: Path) -> int:
    from pdserve.workers.bench.report import format_report, write_json, write_plot

    print(format_report(result))
    write_json(result, out / "report.json")
    write_plot(result, out / "report.png")
    print(f"wrote {out / 'report.json'}, {out / 'report.png'} and {out / 'pool.yaml'}")
    overall = result.metrics.overall
    if overall.requests == 0 or overall.succeeded == 0:
        print("pdserve demo: no request succeeded", file=sys.stderr)
        return 1
    return 0
