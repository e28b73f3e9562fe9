"""Which change to the router matters: routers built from several git revisions (or the
working tree) side by side in front of one fake server that answers at once, with
vllm-router as the peer, measured as `test_router_overhead` measures (requests
alternating between the paths, the load in alternating rounds). Each router's added
P50/P99 and requests/s are printed as ratios to the first revision's, same run, with
its CPU time per request (`rnd/b`: the median over the load rounds of its requests/s
over the first revision's in the same round); the rows go to a JSON file.

    python tests/bench/router_levers.py main=<rev> lean=<rev> head=WORKTREE --peer

A revision's router runs its own `pdserve.protocol` and `pdserve.workers` sources
(`git archive` into a temporary directory) with this checkout's environment.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parent)]

import test_router_overhead as bench  # noqa: E402

from pdserve.base.process import start_server  # noqa: E402
from pdserve.operator import render  # noqa: E402
from support.fake_server import fake_server  # noqa: E402

SOURCES = ("protocol/src", "workers/src")


def sources_of(revision: str, root: Path) -> dict[str, str]:
    """The environment that runs `revision`'s router ({} for the working tree)."""
    if revision == "WORKTREE":
        return {}
    into = root / revision
    if not into.exists():
        archive = subprocess.run(
            ["git", "archive", revision, *SOURCES], capture_output=True, check=True
        ).stdout
        into.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as sources:
            sources.extractall(into, filter="data")
    return {"PYTHONPATH": os.pathsep.join(str(into / part) for part in SOURCES)}


def run(variants: dict[str, str], peer: bool, work: Path, model_dir: Path) -> list[dict[str, Any]]:
    """The rows of one run: direct, each variant's router, vllm-router when `peer`."""
    pool = bench.colocated_pool(model_dir)
    with fake_server() as upstream, ExitStack() as stack:
        routing = work / "routing.json"
        table = render.routing_table(
            "o", "local", pool.spec, {"kind": "static", "decode": [upstream]}
        )
        routing.write_text(render.routing_json(table))
        routers = {}
        for name, revision in variants.items():
            env = sources_of(revision, work / "revisions")
            router = start_server(
                "router", work / f"{name}.log", ["--config", str(routing)], env=env
            )
            stack.callback(router.stop)
            routers[name] = router
        urls, pids = {"direct": upstream}, {}
        for name, router in routers.items():
            router.wait_ready()
            urls[name], pids[name] = router.url, router.process.pid
        if peer:
            running = stack.enter_context(bench.vllm_router(upstream, work / "vllm-router.log"))
            if running is not None:
                urls["vllm-router"], pids["vllm-router"] = running
        rows: list[dict[str, Any]] = bench.measure("fake server", urls, pids)
        return rows


def ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's figures against the first router's (rows[1])."""
    base = rows[1]
    for row in rows:
        for key, of in (("p50", "added_p50_ms"), ("p99", "added_p99_ms"), ("rps", "max_req_per_s")):
            row[f"{key}_vs_base"] = row[of] / base[of] if base[of] else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'path':12s} {'P50':>7s} {'P99':>7s} {'+P50':>7s} {'+P99':>7s} {'req/s':>6s} "
    head += f"{'+P50/b':>7s} {'+P99/b':>7s} {'rps/b':>6s} {'rnd/b':>6s} {'cpu us/req':>10s}"
    lines = [head]
    for r in rows:
        cpu = r["cpu_us_per_request"]
        lines.append(
            f"{r['path']:12s} {r['p50_ms']:7.3f} {r['p99_ms']:7.3f} {r['added_p50_ms']:7.3f} "
            f"{r['added_p99_ms']:7.3f} {r['max_req_per_s']:6.0f} {r['p50_vs_base']:7.2f} "
            f"{r['p99_vs_base']:7.2f} {r['rps_vs_base']:6.2f} {r['median_round_ratio']:6.3f} "
            + (f"{cpu:10.0f}" if cpu is not None else f"{'-':>10s}")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "variants", nargs="+", help="name=git-revision (or WORKTREE); the first is the base"
    )
    parser.add_argument("--peer", action="store_true", help="vllm-router beside them")
    parser.add_argument("--sequential", type=int, default=bench.SEQUENTIAL)
    parser.add_argument("--load-seconds", type=float, default=bench.LOAD_SECONDS)
    parser.add_argument(
        "--model", type=Path, default=Path.home() / ".cache/pdserve/models/tiny-llama"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench/router_levers.json"))
    args = parser.parse_args()
    bench.SEQUENTIAL, bench.LOAD_SECONDS = args.sequential, args.load_seconds
    variants = dict(spec.split("=", 1) for spec in args.variants)
    with tempfile.TemporaryDirectory(prefix="router-levers-") as work:
        rows = run(variants, args.peer, Path(work), args.model)
    ratios(rows)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"variants": variants, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
