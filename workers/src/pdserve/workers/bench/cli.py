"""`pdserve bench`: drive an OpenAI-compatible server and report latency and goodput."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.bench.config import BenchConfig

# Kept in step with workloads.WORKLOADS (and prefix_workloads.MULTI_TURN) by a test;
# importing them here would pull numpy into every `pdserve --help`.
WORKLOAD_NAMES = ("chat", "rag", "long", "mixed", "multi-turn")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `bench` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="load-test a server: TTFT, ITL, TPOT, E2E, throughput, goodput",
        description=__doc__,
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add_traffic_arguments(parser)
    _add_slo_arguments(parser)
    _add_output_arguments(parser)
    parser.set_defaults(handler=_run)


def add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say what traffic a run sends (a workload or a trace, arrivals,
    lengths): the bench's, and the simulator's, which replays the same traffic."""
    traffic = parser.add_mutually_exclusive_group(required=True)
    traffic.add_argument(
        "--workload", choices=WORKLOAD_NAMES,
        help="synthetic workload class (multi-turn: conversations over shared system "
        "prompts; --rate is conversations per second)",
    )  # fmt: skip
    parser.add_argument(
        "--long-share", type=float, metavar="F",
        help="mixed workload: share of long (rag) prompts (default 0.15)",
    )  # fmt: skip
    traffic.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay a trace: CSV (Azure), or JSON lines with prefix block hashes (Mooncake)",
    )
    _add_run_arguments(parser)
    _add_length_arguments(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals and run length")
    add = group.add_argument
    add(
        "--rate",
        type=float,
        metavar="R",
        help="workloads: requests/s (default 2; inf: all at once, needs --num-requests)",
    )
    add("--arrival", choices=("poisson", "gamma"), help="workloads: default poisson")
    add(
        "--burstiness",
        type=float,
        metavar="CV",
        help="workloads, gamma arrivals: CV of the gaps between arrivals (default 1)",
    )
    add(
        "--duration",
        type=float,
        metavar="S",
        help="seconds of arrivals (default 60 unless --num-requests is given)",
    )
    add("--num-requests", type=int, metavar="N", help="stop after N requests")
    add("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    add("--concurrency-limit", type=int, metavar="N", help="at most N requests in flight")
    add(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds after the arrivals end for requests to finish (default 60); "
        "later ones are cancelled and count as failed",
    )


def _add_length_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompts and lengths")
    add = group.add_argument
    add("--model", metavar="NAME", help="model name (default: the first at /v1/models)")
    add(
        "--vocab-size",
        type=int,
        default=256,
        metavar="V",
        help="prompt token ids are drawn from [3, V) (default 256)",
    )
    add("--max-input-tokens", type=int, metavar="N", help="clip prompt lengths")
    add("--max-output-tokens", type=int, metavar="N", help="clip output lengths")
    add(
        "--trace-time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply trace arrival offsets (0.5: twice as fast)",
    )
    add(
        "--trace-length-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply trace prompt and output lengths",
    )
    add(
        "--trace-prefix-share",
        type=float,
        metavar="F",
        help="a trace with prefix block hashes: replay only the requests of a share F of "
        "its prefix groups (same first block), drawn from the seed, keeping their reuse",
    )


def _add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLOs (goodput counts the requests meeting all given)")
    add = group.add_argument
    add("--slo-ttft-ms", type=float, metavar="MS", help="time to first token")
    add("--slo-tpot-ms", type=float, metavar="MS", help="time per output token")
    add("--slo-itl-ms", type=float, metavar="MS", help="every gap between tokens of a request")
    add("--slo-e2e-ms", type=float, metavar="MS", help="end-to-end latency")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json", type=Path, metavar="OUT", help="every figure, per-request rows")
    group.add_argument("--plot", type=Path, metavar="OUT.png", help="ITL over time, TTFT")


def _run(args: argparse.Namespace) -> int:
    from pdserve.workers.bench.client import ServerError
    from pdserve.workers.bench.config import ConfigError
    from pdserve.workers.bench.report import format_report, write_json, write_plot
    from pdserve.workers.bench.runner import run_benchmark
    from pdserve.workers.bench.trace import TraceError

    try:
        config = config_from_args(args)
        result = run_benchmark(config)
    except (ConfigError, TraceError) as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 2
    except ServerError as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json is not None:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    overall = result.metrics.overall
    return 1 if overall.requests and overall.succeeded == 0 else 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration from parsed arguments (raises ConfigError on misuse)."""
    from pdserve.workers.bench.config import DEFAULT_RATE, BenchConfig, ConfigError
    from pdserve.workers.bench.metrics import SLO

    if args.trace is not None:
        given = [
            f"--{n}" for n in ("rate", "arrival", "burstiness") if getattr(args, n) is not None
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} do not apply to trace replay")
    return BenchConfig(
        url=args.url,
        workload=args.workload,
        long_share=args.long_share,
        trace=args.trace,
        model=args.model,
        rate=DEFAULT_RATE if args.rate is None else args.rate,
        arrival=args.arrival or "poisson",
        burstiness=1.0 if args.burstiness is None else args.burstiness,
        duration_s=args.duration,
        num_requests=args.num_requests,
        seed=args.seed,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_ms, args.slo_e2e_ms),
        vocab_size=args.vocab_size,
        trace_time_scale=args.trace_time_scale,
        trace_length_scale=args.trace_length_scale,
        trace_prefix_share=args.trace_prefix_share,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        concurrency_limit=args.concurrency_limit,
        drain_timeout_s=args.drain_timeout,
    )
