"""`pdserve profile` (measure a model's costs on this machine) and `pdserve simulate`
(the simulator behind `pdserve plan`: scenarios in, figures out, as JSON lines)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.workers.bench.cli import add_traffic_arguments

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    """Add `pdserve profile` and `pdserve simulate`."""
    _register_profile(subparsers)
    _register_simulate(subparsers)


def _register_profile(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure a model's step cost, hand-off time and start-up on this machine",
        description="Measure what `pdserve plan` simulates with: the engine's step time "
        "over a designed sweep of decode tokens, prefill tokens and attended context "
        "(fitted as the engine's step-cost model, with the fit's error), the KV hand-off "
        "time by bytes between a prefill and a decode worker, and a worker's start-up.",
    )
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write")
    parser.add_argument(
        "--sweep", choices=("quick", "full"), default="full",
        help="the sweep's size: quick (a few dozen steps, for tests) or full",
    )  # fmt: skip
    parser.add_argument(
        "--no-handoff", action="store_true",
        help="skip the worker pair (hand-off time and start-up are then not measured)",
    )  # fmt: skip
    parser.add_argument(
        "--no-contention", action="store_true",
        help="skip timing workers stepping together (steps on a shared machine are then "
        "only stretched by the cores shared out)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-transfer", choices=("nixl", "torch"), default="nixl",
        help="the pair's KV transfer backend (default nixl)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-arg", action="append", default=[], metavar="ARG",
        help="a `pdserve worker` flag the profile runs under (repeatable), e.g. "
        "--worker-arg=--dtype=float32",
    )  # fmt: skip
    parser.set_defaults(handler=_run_profile)


def _register_simulate(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate pools over a trace on a profile (what `pdserve plan` runs)",
        description="Read scenarios, one JSON object a line (a routing table whose "
        "discovery lists the workers, and each role's `pdserve worker` arguments), from "
        "--scenarios (- for stdin); write each one's figures as a JSON line.",
    )
    parser.add_argument("--profile", type=Path, required=True, help="a `pdserve profile` file")
    parser.add_argument(
        "--scenarios", default="-", metavar="FILE", help="JSON lines of scenarios (- : stdin)"
    )
    add_traffic_arguments(parser)
    parser.set_defaults(
        handler=_run_simulate, url="simulated",
        slo_ttft_ms=None, slo_tpot_ms=None, slo_itl_ms=None, slo_e2e_ms=None,
    )  # fmt: skip


def _run_profile(args: argparse.Namespace) -> int:
    from pdserve.workers.plan.costs import write_profile
    from pdserve.workers.plan.profile import ProfileRun, profile_model

    run = ProfileRun(
        args.model, args.sweep, not args.no_handoff, args.kv_transfer, tuple(args.worker_arg),
        not args.no_contention,
    )  # fmt: skip
    profile = profile_model(run, progress=lambda line: print(line, file=sys.stderr))
    write_profile(profile, args.output)
    fit = profile.step_fit
    print(
        f"wrote {args.output}: {fit.samples} steps, step-time fit error mean "
        f"{fit.mean_abs:.1%}, p90 {fit.p90_abs:.1%}"
        + ("" if fit.holdout_mean_abs is None else f", held out {fit.holdout_mean_abs:.1%}")
    )
    for name, spread in profile.spreads.items():
        if spread.rounds:
            rounds = ", ".join(f"{value:.4g}" for value in spread.rounds)
            print(f"  {name}: rounds {rounds}")
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    from pdserve.workers.bench.cli import config_from_args
    from pdserve.workers.bench.config import ConfigError
    from pdserve.workers.bench.trace import TraceError
    from pdserve.workers.plan.costs import ProfileError, load_profile
    from pdserve.workers.plan.scenario import ScenarioError, parse_scenario
    from pdserve.workers.plan.simulate import simulate, traffic_of

    try:
        profile = load_profile(args.profile)
        traffic = traffic_of(config_from_args(args), profile.model)
    except (ConfigError, TraceError, ProfileError, OSError) as error:
        # OSError: a prefix trace's prompts need the profiled model's tokenizer.
        print(f"pdserve simulate: {error}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        source = sys.stdin if args.scenarios == "-" else stack.enter_context(open(args.scenarios))
        for line in source:
            if not line.strip():
                continue
            try:
                answer = simulate(parse_scenario(line), profile, traffic)
            except ScenarioError as error:
                answer = {"error": str(error)}
            print(json.dumps(answer), flush=True)
    return 0
