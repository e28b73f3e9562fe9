"""A pdserve worker against `transformers serve --continuous-batching` (Hugging Face's
own OpenAI-compatible server), on the same checkpoint, one torch thread each, the same
replay of the Azure conversation trace at five rates, side by side in one run: the
two servers take turns at each rate (in alternating order), both started once and
warm (each answers one request before the first round). Goodput, TTFT and ITL
percentiles and output tokens/s of each, and the highest rate each sustains with the
SLO met (goodput in DistServe's sense: at least SLO_ATTAINMENT of its requests within
both targets); at a rate both sustain, both serve what arrives, so the ratio that
says which server carries more is that of the highest rates. Run with `make bench`.

The replay is about a hundred requests of the trace (21 seconds of it), their prompts
and outputs scaled to a quarter, at rates from one both servers keep up with on one
thread of a two-core machine to past what the peer sustains: long enough that a server
short of the rate builds a backlog that the targets see (with forty requests both met
the SLO on every request up to 6 req/s: the peer fell behind, 298 output tokens/s
against 379 asked, but forty requests end before its queue costs 5 s). Both
servers get the same KV cache capacity and the same tokens per step. transformers
sizes its paged cache by default at 90% of the free memory, which on a CPU is the
host's RAM (about 14 GB resident here, allocated when the first request arrives,
which then waits about 40 s), and its eager attention builds one mask over every
token of the batch against every cached token it reads; so it is given pdserve's
cache capacity (`--cb-num-blocks`) and step size (`--cb-max-batch-tokens`).

transformers' server takes no token-id prompts and refuses `ignore_eos`: both get the
same prompts as text (the benchmark's token ids decoded with the checkpoint's
tokenizer) and stop at EOS as they will. The checkpoint is the project's generated
tiny Llama (4 layers, hidden 256, its own byte-level BPE tokenizer): no real small
Llama checkpoint can be fetched from a package registry here.
"""

from __future__ import annotations

import asyncio
import csv
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import SLO
from pdserve.workers.bench.runner import BenchResult, run_benchmark
from support.network import free_port
from support.results import publish
from support.worker import running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"
WINDOW = (600.0, 621.0)  # seconds of the trace replayed (99 requests)
RATES = (4.0, 6.0, 8.0, 12.0, 16.0)  # requests per second: the window squeezed to each
LENGTH_SCALE = 0.25  # prompts of 100-1,000 tokens, outputs of 9-64
MAX_INPUT, MAX_OUTPUT = 2048, 256
# pdserve's defaults, given to both: KV cache for 8 full contexts, tokens per step.
KV_CACHE_TOKENS = 8 * 16384
STEP_TOKENS = 512
PEER_PAGE_TOKENS = 256  # transformers' cache page
SLO_TTFT_MS, SLO_TPOT_MS = 5000.0, 200.0
DRAIN_S = 300.0
SLO_ATTAINMENT = 0.9  # a rate is sustained when this share of requests meet the SLO
GOODPUT_GOAL = 1.5  # the highest rate sustained, against the peer's


def trace_window(path: Path) -> tuple[Path, int]:
    """The WINDOW of the trace as a trace of its own; its request count."""
    with TRACE.open(newline="") as source:
        rows = list(csv.reader(source))
    header, body = rows[0], rows[1:]
    start = datetime.fromisoformat(body[0][0][:26])
    kept = [
        row
        for row in body
        if WINDOW[0] <= (datetime.fromisoformat(row[0][:26]) - start).total_seconds() < WINDOW[1]
    ]
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows([header, *kept])
    return path, len(kept)


@contextmanager
def transformers_server(model_dir: Path, log_path: Path) -> Iterator[str]:
    """`transformers serve --continuous-batching` on the checkpoint, one torch thread."""
    port = free_port()
    binary = Path(sys.executable).parent / "transformers"
    command = [str(binary), "serve", "--continuous-batching", "--host", "127.0.0.1",
               "--port", str(port), "--cb-num-blocks", str(KV_CACHE_TOKENS // PEER_PAGE_TOKENS),
               "--cb-max-batch-tokens", str(STEP_TOKENS), str(model_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_healthy(url, process))
        yield url
    finally:
        process.terminate()
        process.wait(30)


async def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            assert process.poll() is None, "transformers serve exited: see its log"
            try:
                async with session.get(f"{url}/health") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not start"
            await asyncio.sleep(1.0)


async def warm_up(url: str, model: str) -> None:
    """One short request, answered in full: a server's first request pays for what it
    sets up lazily (transformers allocates its cache then), which no round should."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 8}
    timeout = aiohttp.ClientTimeout(total=DRAIN_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/completions", json=body) as answer,
    ):
        assert answer.status == 200, await answer.text()


def replay(
    url: str, model: str, trace: Path, count: int, scale: float, model_dir: Path
) -> BenchResult:
    """The trace's `count` requests, their arrivals stretched by `scale`."""
    config = BenchConfig(
        url=url,
        model=model,
        trace=trace,
        num_requests=count,  # all of them, however long the stretched window
        trace_time_scale=scale,
        trace_length_scale=LENGTH_SCALE,
        max_input_tokens=MAX_INPUT,
        max_output_tokens=MAX_OUTPUT,
        seed=5,
        slo=SLO(ttft_ms=SLO_TTFT_MS, tpot_ms=SLO_TPOT_MS),
        drain_timeout_s=DRAIN_S,
        text_prompts=model_dir,
        ignore_eos=False,
    )
    return run_benchmark(config)


def row(server: str, rate: float, result: BenchResult) -> dict[str, Any]:
    metrics = result.metrics.overall
    errors = [record.error for record in result.records if record.error]

    def ms(distribution: Any, quantile: str) -> float | None:
        return None if distribution is None else 1e3 * getattr(distribution, quantile)

    return {
        "rate_rps": rate,
        "server": server,
        "requests": metrics.requests,
        "failed": metrics.failed,
        "goodput_rps": metrics.goodput,
        "slo_attainment": metrics.slo_attainment,
        "ttft_p50_ms": ms(metrics.ttft, "p50"),
        "ttft_p99_ms": ms(metrics.ttft, "p99"),
        "itl_p50_ms": ms(metrics.itl, "p50"),
        "itl_p99_ms": ms(metrics.itl, "p99"),
        "output_tok_per_s": metrics.output_throughput,
        "first_error": errors[0][:120] if errors else "",
    }


def test_engine_against_transformers_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    trace, count = trace_window(tmp_path / "window.csv")
    span = WINDOW[1] - WINDOW[0]
    rows = []
    with (
        running_worker(tiny_model_dir, tmp_path / "pdserve") as worker,
        transformers_server(tiny_model_dir, tmp_path / "transformers.log") as peer,
    ):
        servers = {
            "pdserve": (worker.url, "tiny-llama"),
            "transformers": (peer, str(tiny_model_dir)),
        }
        for url, model in servers.values():
            asyncio.run(warm_up(url, model))
        for turn, rate in enumerate(RATES):
            order = list(servers) if turn % 2 == 0 else list(servers)[::-1]
            scale = count / (span * rate)
            for name in order:
                url, model = servers[name]
                result = replay(url, model, trace, count, scale, tiny_model_dir)
                rows.append(row(name, rate, result))
                print(rows[-1], flush=True)
    publish("engine_vs_transformers", rows, {"verdict": verdict(rows), "requests": count})


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ahead on TTFT, ITL and goodput at every rate; the highest rate each server
    sustains (SLO_ATTAINMENT of its requests meet the SLO, at that rate and every lower
    one), and ours at least GOODPUT_GOAL x the peer's."""
    by_rate: dict[float, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_rate.setdefault(r["rate_rps"], {})[r["server"]] = r
    ahead = {}
    for rate, pair in sorted(by_rate.items()):
        ours, peer = pair["pdserve"], pair["transformers"]
        ahead[rate] = {
            "ttft_p50_ratio": _ratio(ours["ttft_p50_ms"], peer["ttft_p50_ms"]),
            "itl_p50_ratio": _ratio(ours["itl_p50_ms"], peer["itl_p50_ms"]),
            "goodput_ratio": _ratio(ours["goodput_rps"], peer["goodput_rps"]),
        }
    sustained = {
        server: highest_sustained(by_rate, server) for server in ("pdserve", "transformers")
    }
    ratio, note = sustained_ratio(sustained["pdserve"], sustained["transformers"], sorted(by_rate))
    return {
        "by_rate": ahead,
        "highest_rate_sustained_rps": sustained,
        "highest_rate_ratio": ratio,
        "goal_met": ratio is not None and ratio >= GOODPUT_GOAL,
        "note": note,
    }


def sustained_ratio(
    ours: float | None, theirs: float | None, rates: list[float]
) -> tuple[float | None, str]:
    """Our highest sustained rate over the peer's, and what bounds it: where a server
    sustains every rate tried its limit is higher, where it sustains none lower (the
    ratio is then at least ours over the lowest rate tried)."""
    lowest, top = rates[0], rates[-1]
    if theirs == top:  # neither limit found: no ratio to judge
        return None, "the peer sustains every rate tried: higher rates needed"
    if ours is None:
        return None, "ours sustains no rate tried: lower rates needed"
    if theirs is None:
        bound = "" if ours < top else ", ours every rate tried"
        return ours / lowest, f"the peer sustains no rate tried{bound}: a lower bound"
    if ours == top:
        return ours / theirs, "ours sustains every rate tried: a lower bound"
    return ours / theirs, ""


def highest_sustained(by_rate: dict[float, dict[str, dict[str, Any]]], server: str) -> float | None:
    """The highest rate up to which `server` met the SLO at every rate tried."""
    highest = None
    for rate, pair in sorted(by_rate.items()):
        attainment = pair[server]["slo_attainment"]
        if attainment is None or attainment < SLO_ATTAINMENT:
            break
        highest = rate
    return highest


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or not theirs:
        return None
    return ours / theirs
