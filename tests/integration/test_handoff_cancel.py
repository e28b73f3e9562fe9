"""Hand-offs that clients walk away from, for both transfer backends: cancelling one
never fails the others on the same pair, a thousand of them leave no threads, files,
pairs or blocks behind, and prefill workers that never answer do not hold up
hand-offs to one that does."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.faults import Fault
from support.engine import make_engine, run_to_completion
from support.fake_peer import silent_peer
from support.pd import (
    PDPair,
    complete,
    fault_fired,
    pd_workers,
    resources,
    token_ids,
    wait_for_log,
)
from support.worker import metric

STALL_S = 1.0  # every prefill waits this long before its write: cancels land mid-hand-off
LEASE_S = 10.0
CANCELS = 1000
AT_ONCE = 50
# Threads and files that come and go with load, not with the number of hand-offs: the
# hand-off's two bounded thread pools (blocking.py) and asyncio's default pool; the
# keep-alive connections of the decode worker's HTTP client to the prefill worker
# (aiohttp keeps up to 100, closing idle ones after 15 s), at both ends. A leak grows
# with the thousand cancels instead (a pair each: threads and sockets).
THREAD_ALLOWANCE = 4 + 16 + 6
FILE_ALLOWANCE = 100 + 16


@pytest.fixture(scope="module", params=["nixl", "torch"])
def workers(
    request: pytest.FixtureRequest, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp(f"cancel-{request.param}")
    decode_args = ["--transfer-failure-policy", "fail", "--handoff-timeout", str(LEASE_S)]
    with pd_workers(
        small_model_dir, logs, request.param, decode_args=decode_args,
        prefill_faults={"prefill.before_write": Fault(delay_s=STALL_S)},
    ) as started:  # fmt: skip
        yield started


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(8)
    lengths = torch.randint(1, 200, (20,), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def expected(small_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return run_to_completion(make_engine(small_model_dir), prompts, params)[0]


def settled(workers: PDPair, timeout_s: float = 60.0) -> None:
    """Wait until both workers hold no KV blocks (every hand-off settled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = [
            metric(w, "pdserve_kv_cache_usage_ratio") for w in workers.prefill + workers.decode
        ]
        if not any(usage):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still in use after {timeout_s}s")


def test_one_cancelled_hand_off_leaves_the_other_nineteen_alone(
    workers: PDPair, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    decode, prefill = workers.decode[0], workers.prefill[0]
    failures = metric(decode, "pdserve_kv_transfer_failures_total")
    fired = prefill.log().count(fault_fired("prefill.before_write"))

    async def twenty() -> list[tuple[int, dict[str, object]] | BaseException]:
        async with aiohttp.ClientSession() as session:
            calls = [
                asyncio.ensure_future(complete(session, decode.url, prompt, prefill.url))
                for prompt in prompts
            ]
            # Every prefill has been computed and waits to write: cancel one.
            await wait_for_log(prefill, fault_fired("prefill.before_write"), fired + 20)
            calls[7].cancel()
            return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(twenty())
    assert isinstance(answers[7], asyncio.CancelledError)
    for index, answer in enumerate(answers):
        if index != 7:
            assert not isinstance(answer, BaseException), answer
            status, body = answer
            assert status == 200, body
            assert token_ids(body) == expected[index]
    assert metric(decode, "pdserve_kv_transfer_failures_total") == failures
    settled(workers)


def test_a_thousand_cancelled_hand_offs_leave_nothing_behind(
    workers: PDPair, prompts: list[list[int]], expected: list[list[int]], tmp_path: Path
) -> None:
    decode, prefill = workers.decode[0], workers.prefill[0]

    async def cancelled(count: int) -> None:
        async with aiohttp.ClientSession() as session:
            limit = asyncio.Semaphore(AT_ONCE)

            async def one(index: int) -> None:
                async with limit:
                    prompt = prompts[index % len(prompts)]
                    call = asyncio.ensure_future(complete(session, decode.url, prompt, prefill.url))
                    await asyncio.sleep(0.2)  # under way: reserved, or prefilling
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)

            await asyncio.gather(*(one(index) for index in range(count)))

    roles = {"prefill": prefill, "decode": decode}
    asyncio.run(cancelled(AT_ONCE))  # the pools and connections a busy worker has
    settled(workers)
    before = {role: resources(w) for role, w in roles.items()}
    peers_before = {role: metric(w, "pdserve_kv_transfer_peers") for role, w in roles.items()}

    fired = prefill.log().count(fault_fired("prefill.before_write"))
    started = time.monotonic()
    asyncio.run(cancelled(CANCELS))
    settled(workers)
    seconds = time.monotonic() - started
    reached = prefill.log().count(fault_fired("prefill.before_write")) - fired

    after = {role: resources(w) for role, w in roles.items()}
    peers_after = {role: metric(w, "pdserve_kv_transfer_peers") for role, w in roles.items()}
    record = {
        "cancelled": CANCELS,
        "prefilled_before_the_cancel": reached,
        "seconds": round(seconds, 1),
        "before": {role: vars(r) for role, r in before.items()},
        "after": {role: vars(r) for role, r in after.items()},
        "peers_before": peers_before,
        "peers_after": peers_after,
    }
    print(f"\n{json.dumps(record)}")
    for role in before:
        assert after[role].threads <= before[role].threads + THREAD_ALLOWANCE, record
        assert after[role].open_files <= before[role].open_files + FILE_ALLOWANCE, record
        assert peers_after[role] <= max(peers_before[role], 1), record

    # The pair still serves.
    async def again() -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession() as session:
            return await complete(session, decode.url, prompts[0], prefill.url)

    status, body = asyncio.run(again())
    assert status == 200 and token_ids(body) == expected[0]


def test_prefill_workers_that_never_answer_do_not_hold_up_hand_offs(
    workers: PDPair, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    decode, prefill = workers.decode[0], workers.prefill[0]

    async def real_beside_silent(silent: str) -> list[tuple[int, dict[str, object]]]:
        async with aiohttp.ClientSession() as session:
            # Forty prefill workers that accept and never answer, each its own URL.
            stuck = [
                asyncio.ensure_future(complete(session, decode.url, prompts[0], f"{silent}/p{i}"))
                for i in range(40)
            ]
            await asyncio.sleep(0.5)
            real = [complete(session, decode.url, p, prefill.url) for p in prompts[:10]]
            answers = await asyncio.gather(*real)
            for call in stuck:
                call.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            return answers

    with silent_peer() as silent:
        answers = asyncio.run(real_beside_silent(silent))
    for (status, body), tokens in zip(answers, expected[:10], strict=True):
        assert status == 200, body
        assert token_ids(body) == tokens
