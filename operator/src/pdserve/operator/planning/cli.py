"""`pdserve plan -f pool.yaml --trace T --profile P`: search pools for the fewest
workers meeting the pool's SLO on the trace, print what was tried and the answer in
words, and write the recommended ServingPool."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.operator.planning.search import Trial

# The traffic flags passed on to `pdserve simulate` (the bench's), with their types.
TRAFFIC_FLAGS: dict[str, type] = {
    "rate": float,
    "duration": float,
    "num-requests": int,
    "seed": int,
    "max-input-tokens": int,
    "max-output-tokens": int,
    "trace-time-scale": float,
    "trace-length-scale": float,
    "vocab-size": int,
}
WORKLOADS = ("chat", "rag", "long", "mixed")
DEFAULT_REPORT_BUCKETS = (256, 1024, 4096)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve plan`."""
    parser = subparsers.add_parser(
        "plan",
        help="find the fewest workers that meet a pool's SLO on a trace (simulated)",
        description=__doc__.splitlines()[0].strip("`") if __doc__ else None,
    )
    parser.add_argument("-f", "--file", type=Path, required=True, metavar="POOL.yaml",
                        help="the ServingPool (its spec.slo is the target)")  # fmt: skip
    parser.add_argument("--profile", type=Path, required=True,
                        help="a `pdserve profile` file of the model on the hardware")  # fmt: skip
    traffic = parser.add_mutually_exclusive_group(required=True)
    traffic.add_argument("--trace", type=Path, metavar="FILE", help="a trace CSV (Azure)")
    traffic.add_argument("--workload", choices=WORKLOADS, help="a synthetic workload")
    for flag, kind in TRAFFIC_FLAGS.items():
        parser.add_argument(f"--{flag}", type=kind, help="as for `pdserve bench`")
    parser.add_argument("-o", "--output", type=Path, metavar="OUT.yaml",
                        help="the recommended ServingPool (default: POOL.plan.yaml)")  # fmt: skip
    parser.add_argument("--max-workers", type=int, metavar="N",
                        help="try no role with more than N workers")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="OUT.json",
                        help="every trial's figures")  # fmt: skip
    parser.add_argument("--one-host", action="store_true",
                        help="simulate every worker, the router and the clients on one "
                        "machine like the profiled one, sharing its cores (as `pdserve "
                        "local` runs them); default: a node per worker, as a ServingPool's "
                        "pods")  # fmt: skip
    parser.set_defaults(handler=_run)


def traffic_args(args: argparse.Namespace) -> list[str]:
    """The flags of `pdserve simulate` that say what traffic to replay."""
    given = ["--trace", str(args.trace)] if args.trace else ["--workload", args.workload]
    for flag in TRAFFIC_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            given += [f"--{flag}", str(value)]
    return given


def _run(args: argparse.Namespace) -> int:
    from pdserve.operator.api import InvalidPoolError
    from pdserve.operator.local.pool import LocalPoolError
    from pdserve.operator.planning.plan import run_plan
    from pdserve.operator.planning.simulator import PLACEMENTS, PlanError

    output = args.output or args.file.with_suffix(".plan.yaml")
    try:
        placement = PLACEMENTS[1] if args.one_host else PLACEMENTS[0]
        return run_plan(args.file, args.profile, traffic_args(args), output, args.max_workers,
                        args.json, _progress, placement)  # fmt: skip
    except (InvalidPoolError, LocalPoolError, PlanError) as error:
        print(f"pdserve plan: {error}", file=sys.stderr)
        return 2


def _progress(trial: Trial) -> None:
    result = trial.result
    draws = result.get("draws", 1)
    speed = result["simulated_s"] * draws / max(result["wall_s"], 1e-9)
    mark = "meets" if trial.meets else "misses"
    print(f"  {trial.candidate.name}: {mark} the SLO ({draws} x {result['simulated_s']:.0f}s "
          f"simulated in {result['wall_s']:.1f}s, {speed:.0f}x)",
          file=sys.stderr, flush=True)  # fmt: skip
