"""The simulator routes KV-aware as the router does and finds the prefix-cache hits the
engines find: a list of conversations sharing system prompts and histories is sent,
one request at a time, through a real router to real workers (one prefill, two
decode, KV-aware, prompts of up to BOUNDARY uncached tokens colocated), and replayed
by the simulator on the same configuration. Request by request, the mode, the
router's reason for its decode worker, the cached tokens it predicted there and the
cached tokens the engine reported are the same. Nothing here depends on timing: each
request is sent once the router's index holds every event of the one before."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.base.process import ServerProcess
from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.bench.prefix_workloads import TRACE_BLOCK_TOKENS, PrefixRow, prompt_text
from pdserve.workers.kv_wire import SNAPSHOT_PATH
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.kv_pool import feeds, kv_router, metric, routing_file, wait_synced
from support.pd import PDPair, internal_headers, pd_workers
from support.plan import constant_profile, scenario_line
from support.waiting import wait_until

BACKEND = "nixl"
BLOCK = 16
BOUNDARY = 64
SEED = 5
LENGTH_SCALE = 1 / 16  # a trace block of 512 tokens: about 32 tokens
MAX_TOKENS = 4
# Conversations as trace blocks: two over one system prompt (blocks 0, 1), one over
# another (2, 3); each turn's prompt is the whole history and a new message.
A = [(0, 1, 100), (0, 1, 100, 101, 102), (0, 1, 100, 101, 102, 103, 104)]
B = [(0, 1, 200), (0, 1, 200, 201, 202)]
C = [(2, 3, 300), (2, 3, 300, 301, 302)]
ORDER = [A[0], B[0], C[0], A[1], B[1], C[1], A[2]]
DECISIONS = "pdserve_router_kv_decisions_total"
PREDICTED = "pdserve_router_kv_predicted_hit_tokens_total"


@dataclass(frozen=True)
class Routed:
    """What one request's routing decided and found."""

    mode: str
    reason: str  # the router's KV decision for the decode worker
    predicted: int  # cached tokens the router expected on the decode worker
    hits: int  # cached tokens the decode worker's engine found


def rows() -> list[PrefixRow]:
    return [
        PrefixRow(float(i), ids, len(ids) * TRACE_BLOCK_TOKENS, MAX_TOKENS)
        for i, ids in enumerate(ORDER)
    ]


@pytest.fixture(scope="module")
def workers(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    log_dir = tmp_path_factory.mktemp("kv-parity")
    with pd_workers(small_model_dir, log_dir, BACKEND, prefills=1, decodes=2) as started:
        yield started


def worker_seq(url: str) -> int:
    """The number of the worker's last KV event."""
    request = urllib.request.Request(url + SNAPSHOT_PATH, headers=internal_headers(url))
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(json.load(answer)["seq"])


def wait_indexed(router: ServerProcess, urls: list[str]) -> None:
    """Until the router's index holds every event the workers have published."""
    wanted = {url: worker_seq(url) for url in urls}
    wait_until(
        lambda: all(feeds(router.url)[url]["seq"] >= seq for url, seq in wanted.items()),
        30, "the router's index to hold the workers' events",
    )  # fmt: skip


def send_real(router: ServerProcess, text: str) -> tuple[str, int]:
    """A completion of `text` through the router: the mode served, the cached tokens."""
    body = {"prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{router.url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        usage = json.load(answer)["usage"]
        return answer.headers["X-Pdserve-Mode"], int(
            usage["prompt_tokens_details"]["cached_tokens"]
        )


def run_real(workers: PDPair, model_dir: Path, folder: Path) -> list[Routed]:
    decodes = [w.url for w in workers.decode]
    prefills = [w.url for w in workers.prefill]
    table = routing_file(folder, model_dir, decodes, prefills, boundary=BOUNDARY, block_size=BLOCK)
    assert workers.peers is not None
    credential = workers.peers.parent / f"{BACKEND}-pool.credential"
    routed: list[Routed] = []
    with kv_router(table, credential, folder / "router.log") as router:
        wait_synced(router.url, decodes + prefills)
        for row in rows():
            reasons = {r: metric(router.url, DECISIONS, target="decode", reason=r) for r in REASONS}
            predicted = metric(router.url, PREDICTED, target="decode")
            mode, hits = send_real(router, prompt_text(SEED, row, LENGTH_SCALE))
            wait_indexed(router, decodes + prefills)
            reason = next(
                r for r in REASONS
                if metric(router.url, DECISIONS, target="decode", reason=r) > reasons[r]
            )  # fmt: skip
            guess = int(metric(router.url, PREDICTED, target="decode") - predicted)
            routed.append(Routed(mode, reason, guess, hits))
    return routed


REASONS = ("cache", "load", "none")


def run_simulated(model_dir: Path) -> list[Routed]:
    """The same requests, far apart in simulated time (each ends before the next)."""
    plan = [
        PlannedRequest(i, 10.0 * i, row.input_tokens, MAX_TOKENS, "parity", row)
        for i, row in enumerate(rows())
    ]
    buckets: list[dict[str, Any]] = [
        {"maxInputTokens": BOUNDARY, "mode": "colocated"},
        {"mode": "disaggregated"},
    ]
    line = scenario_line(
        "kv-parity", ["--block-size", str(BLOCK)], ["--block-size", str(BLOCK)],
        num_decode=2, num_prefill=1, buckets=buckets,
    )  # fmt: skip
    traffic = Traffic(plan, SEED, 0, 60.0, None, LENGTH_SCALE, Tokenizer.from_dir(model_dir))
    simulation = PoolSimulation(parse_scenario(line), constant_profile(model_dir, 0.01), traffic)
    records = simulation.run()
    assert all(record.finished for record in records)
    return [
        Routed(
            record.mode or "",
            simulation.routes[i].reason,
            simulation.routes[i].cached_tokens,
            record.usage_cached_tokens or 0,
        )
        for i, record in enumerate(records)
    ]


def test_simulated_routing_and_hits_are_the_routers_and_engines(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    real = run_real(workers, small_model_dir, tmp_path)
    simulated = run_simulated(small_model_dir)

    assert simulated == real
    # The list was meant to exercise every decision: shared prefixes found, a
    # conversation kept colocated by its cached history, first turns handed off.
    assert {r.reason for r in real} >= {"none", "cache"}
    assert {r.mode for r in real} == {"colocated", "disaggregated"}
    assert sum(r.hits for r in real) > 0
