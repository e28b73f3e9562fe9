"""A real decode worker facing prefill workers that misbehave: a bad answer costs
one request, never the engine; a peer that never answers costs each request one
lease at most, however many queue behind it; a peer's words never become metric
labels."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.protocol.headers import LOCAL_PREFILL_HEADER
from pdserve.protocol.internal import RESOLVE_INTERVAL_S
from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.server.process import ServerProcess
from support.engine import make_engine, run_to_completion
from support.fake_peer import consistent_answer, scripted_peer, silent_peer
from support.pd import complete, join_pool, pool_credential, token_ids
from support.prom import scrape
from support.worker import metric, running_worker

LEASE_S = 2.0
MARGIN_S = 10.0  # a busy machine's allowance; one lease per queued request would be 100 s
PROMPT = list(range(10, 50))  # 40 tokens: 3 blocks of 16

Answer = dict[str, Any]


def _logprob(token: int) -> dict[str, Any]:
    return {"token_id": token, "logprob": -0.5, "rank": 1, "top_ids": [], "top_logprobs": []}


BAD_ANSWERS: list[tuple[str, Callable[[Answer], Any], str]] = [
    ("a first token outside the vocabulary",
     lambda a: {**a, "first_tokens": [1_000_000]}, "first token"),
    ("a negative first token", lambda a: {**a, "first_tokens": [-1]}, "first_tokens"),
    ("a first token as text", lambda a: {**a, "first_tokens": ["5"]}, "first_tokens"),
    ("a huge first token", lambda a: {**a, "first_tokens": [10**30]}, "first token"),
    ("a first token too many", lambda a: {**a, "first_tokens": [5, 5]}, "first tokens"),
    ("no first token", lambda a: {**a, "first_tokens": []}, "first tokens"),
    ("log-probabilities no one asked for",
     lambda a: {**a, "logprobs": [_logprob(5)]}, "logprobs sent"),
    ("fewer blocks than asked for", lambda a: {**a, "blocks": a["blocks"] - 1}, "blocks"),
    ("bytes that do not add up", lambda a: {**a, "bytes": a["bytes"] + 1}, "bytes"),
    ("no descriptors", lambda a: {**a, "descriptors": 0}, "descriptors"),
    ("a duration that is not a number",
     lambda a: {**a, "transfer_seconds": float("nan")}, "transfer_seconds"),
    ("a field too many", lambda a: {**a, "extra": 1}, "extra"),
    ("a field missing", lambda a: {k: v for k, v in a.items() if k != "bytes"}, "bytes"),
    ("not an object", lambda a: [a], "malformed"),
]  # fmt: skip


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file naming the pool's prefill workers: each fake peer is added to it, as
    a pool would add a prefill worker, so the decode worker lets itself be sent there."""
    return tmp_path_factory.mktemp("handoff-peers-pool") / "pool.prefill-peers"


@pytest.fixture(scope="module")
def decode(
    small_model_dir: Path, peers: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A decode worker whose failed hand-offs end with the reason (no recompute)."""
    logs = tmp_path_factory.mktemp("handoff-peers")
    credential, holds = pool_credential(logs)
    peers.touch()
    args = [
        "--role", "decode", "--kv-transfer", "nixl", "--transfer-failure-policy", "fail",
        "--handoff-timeout", str(LEASE_S), *holds, "--prefill-peers-file", str(peers),
    ]  # fmt: skip
    with running_worker(small_model_dir, logs, *args) as worker:
        join_pool(credential, worker)
        yield worker


def admit(peers: Path, peer: str) -> str:
    """Name `peer` as one of the pool's prefill workers; its URL. The decode worker
    re-reads the list at most once per RESOLVE_INTERVAL_S: waiting that long makes its
    next look at the list see `peer`."""
    with peers.open("a") as listed:
        listed.write(f"{peer}\n")
    time.sleep(RESOLVE_INTERVAL_S)
    return peer


def colocated(model_dir: Path, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs, _ = run_to_completion(make_engine(model_dir), [prompt], params)
    return outputs[0]


async def ask(decode: ServerProcess, prefill_url: str | None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        status, answer = await complete(session, decode.url, PROMPT, prefill_url)
        return status, answer


def test_a_bad_answer_costs_one_request_and_the_engine_keeps_serving(
    decode: ServerProcess, peers: Path, small_model_dir: Path
) -> None:
    answers = iter(BAD_ANSWERS)

    def script(body: dict[str, Any], layout: dict[str, Any]) -> tuple[int, Any]:
        _, spoil, _ = next(answers)
        return 200, spoil(consistent_answer(body, layout))

    expected = colocated(small_model_dir, PROMPT)
    failures_before = metric(decode, "pdserve_kv_transfer_failures_total", reason="bad_handoff")
    with scripted_peer(script) as fake:
        peer = admit(peers, fake)
        for what, _, named in BAD_ANSWERS:
            status, answer = asyncio.run(ask(decode, peer))
            assert status == 502, (what, answer)
            assert named in answer["error"]["message"], (what, answer)
            # Served on: the worker answers, and its engine computes right.
            status, answer = asyncio.run(ask(decode, None))
            assert status == 200, (what, answer)
            assert token_ids(answer) == expected, what
    failures = metric(decode, "pdserve_kv_transfer_failures_total", reason="bad_handoff")
    assert failures - failures_before == len(BAD_ANSWERS)
    assert metric(decode, "pdserve_kv_cache_usage_ratio") == 0.0


def test_a_peers_error_codes_never_become_labels(decode: ServerProcess, peers: Path) -> None:
    invented = "invented-code-" + "x" * 40
    replies = iter(
        [
            (500, {"error": {"code": invented, "message": "m" * 100_000}}),
            (503, {"error": {"code": 17}}),
            (502, "not an error object"),
        ]
    )
    before = metric(decode, "pdserve_kv_transfer_failures_total", reason="prefill_failed")
    with scripted_peer(lambda body, layout: next(replies)) as fake:
        peer = admit(peers, fake)
        for _ in range(3):
            status, answer = asyncio.run(ask(decode, peer))
            assert status == 502
            assert len(answer["error"]["message"]) < 1000
    after = metric(decode, "pdserve_kv_transfer_failures_total", reason="prefill_failed")
    assert after - before == 3
    reasons = {
        labels["reason"]
        for name, labels, _ in scrape(f"{decode.url}/metrics")
        if name == "pdserve_kv_transfer_failures_total"
    }
    assert invented not in reasons and "17" not in reasons


def test_requests_queued_behind_a_silent_prefill_worker_end_within_the_lease(
    decode: ServerProcess, peers: Path
) -> None:
    async def fifty(peer: str) -> list[tuple[float, int]]:
        async with aiohttp.ClientSession() as session:

            async def one() -> tuple[float, int]:
                status, _ = await complete(session, decode.url, PROMPT, peer)
                return time.monotonic(), status

            return await asyncio.gather(*(one() for _ in range(50)))

    with silent_peer() as fake:
        started = time.monotonic()
        ended = asyncio.run(fifty(admit(peers, fake)))
    assert [status for _, status in ended] == [502] * 50
    assert max(at for at, _ in ended) - started < LEASE_S + MARGIN_S
    # The worker is not held up either.
    status, _ = asyncio.run(ask(decode, None))
    assert status == 200


def test_a_prompt_computed_here_never_waits_on_the_prefill_worker_named(
    decode: ServerProcess, peers: Path, small_model_dir: Path
) -> None:
    # The decode worker holds all of the prompt but 5 tokens, within the 64 the pool
    # serves colocated: it looks in its cache before it meets the prefill worker named,
    # so a prefill worker that never answers (here, met for the first time) is never
    # contacted, where the meeting would have failed the request at its deadline.
    history = list(range(100, 164))  # 4 blocks
    prompt = [*history, 7, 8, 9, 10, 11]

    async def served(prefill: str | None, tokens: list[int]) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            bound = {LOCAL_PREFILL_HEADER: "64"}
            return await complete(session, decode.url, tokens, prefill, extra_headers=bound)

    accepted: list[str] = []
    with silent_peer(accepted) as fake:
        peer = admit(peers, fake)
        assert asyncio.run(served(None, history))[0] == 200  # cached here now
        status, answer = asyncio.run(served(peer, prompt))
    assert status == 200, answer
    assert token_ids(answer) == colocated(small_model_dir, prompt)
    assert accepted == []
