"""Hand-offs that clients walk away from, for both transfer backends: cancelling one
never fails the others on the same pair, a thousand of them leave no threads, files,
pairs or blocks behind, and prefill workers that never answer do not hold up
hand-offs to one that does."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
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

# Hand-offs' leases: long enough that none runs out while a test holds hand-offs.
LEASE_S = 30.0
CANCELS = 1000
AT_ONCE = 50
# Threads and files that come and go with load, not with the number of hand-offs: the
# hand-off's two bounded thread pools (blocking.py) and asyncio's default pool; the
# keep-alive connections of the decode worker's HTTP client to the prefill worker
# (aiohttp keeps up to 100, closing idle ones after 15 s), at both ends. A leak grows
# with the thousand cancels instead (a pair each: threads and sockets).
THREAD_ALLOWANCE = 4 + 16 + 6
FILE_ALLOWANCE = 100 + 16


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, every prefill waits before its write (its prompt
    computed, its blocks held): cancels land mid-hand-off, on any machine."""
    return tmp_path_factory.mktemp("gate") / "hold-writes"


@pytest.fixture(scope="module", params=["nixl", "torch"])
def workers(
    request: pytest.FixtureRequest,
    small_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gate: Path,
) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp(f"cancel-{request.param}")
    decode_args = ["--transfer-failure-policy", "fail", "--handoff-timeout", str(LEASE_S)]
    with pd_workers(
        small_model_dir, logs, request.param, decode_args=decode_args,
        prefill_faults={"prefill.before_write": Fault(hold_while=str(gate))},
    ) as started:  # fmt: skip
        yield started


@contextmanager
def writes_held(gate: Path) -> Iterator[None]:
    """Hold every prefill's write until the block ends."""
    gate.touch()
    try:
        yield
    finally:
        gate.unlink()


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
    workers: PDPair, prompts: list[list[int]], expected: list[list[int]], gate: Path
) -> None:
    decode, prefill = workers.decode[0], workers.prefill[0]
    failures = metric(decode, "pdserve_kv_transfer_failures_total")
    fired = prefill.log().count(fault_fired("prefill.before_write"))

    async def twenty() -> list[tuple[int, dict[str, object]] | BaseException]:
        async with aiohttp.ClientSession() as session:
            with writes_held(gate):
                calls = [
                    asyncio.ensure_future(complete(session, decode.url, prompt, prefill.url))
                    for prompt in prompts
                ]
                # Every prefill has been computed and waits to write: cancel one.
                await wait_for_log(prefill, fault_fired("prefill.before_write"), fired + 20)
                assert not any(call.done() for call in calls)
                calls[7].cancel()
            return list(await asyncio.gather(*calls, return_exceptions=True))

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
    workers: PDPair, prompts: list[list[int]], expected: list[list[int]], gate: Path
) -> None:
    decode, prefill = workers.decode[0], workers.prefill[0]

    async def cancelled(count: int) -> int:
        """Cancel `count` hand-offs, AT_ONCE at a time, each once its prompt is computed
        and its write held; how many were cancelled mid-hand-off."""
        mid_hand_off = 0
        async with aiohttp.ClientSession() as session:
            for first in range(0, count, AT_ONCE):
                wave = range(first, min(first + AT_ONCE, count))
                fired = prefill.log().count(fault_fired("prefill.before_write"))
                with writes_held(gate):
                    calls = [
                        asyncio.ensure_future(
                            complete(session, decode.url, prompts[i % len(prompts)], prefill.url)
                        )
                        for i in wave
                    ]
                    await wait_for_log(
                        prefill, fault_fired("prefill.before_write"), fired + len(wave)
                    )
                    mid_hand_off += sum(1 for call in calls if not call.done())
                    for call in calls:
                        call.cancel()
                    await asyncio.gather(*calls, return_exceptions=True)
        return mid_hand_off

    roles = {"prefill": prefill, "decode": decode}
    asyncio.run(cancelled(AT_ONCE))  # the pools and connections a busy worker has
    settled(workers)
    before = {role: resources(w) for role, w in roles.items()}
    peers_before = {role: metric(w, "pdserve_kv_transfer_peers") for role, w in roles.items()}

    started = time.monotonic()
    reached = asyncio.run(cancelled(CANCELS))
    settled(workers)
    seconds = time.monotonic() - started

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
    # Every one was cancelled while its prompt's KV waited to be written.
    assert reached == CANCELS, record
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
            # Forty hand-offs to a prefill worker that accepts and never answers.
            stuck = [
                asyncio.ensure_future(complete(session, decode.url, prompts[0], silent))
                for _ in range(40)
            ]
            while not accepted:  # the decode worker is waiting on it
                await asyncio.sleep(0.02)
            real = [complete(session, decode.url, p, prefill.url) for p in prompts[:10]]
            answers = await asyncio.gather(*real)
            # Served while every silent hand-off still waited for its answer (they
            # give up only at their lease, LEASE_S): none was held up behind them.
            assert not any(call.done() for call in stuck)
            for call in stuck:
                call.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            return answers

    assert workers.peers is not None
    listed = workers.peers.read_text()
    accepted: list[str] = []
    with silent_peer(accepted) as silent:
        # The silent server is one of the pool's prefill workers (else the decode
        # worker refuses its URL at once, and nothing waits on it).
        workers.peers.write_text(f"{listed}{silent}\n")
        try:
            answers = asyncio.run(real_beside_silent(silent))
        finally:
            workers.peers.write_text(listed)
    for (status, body), tokens in zip(answers, expected[:10], strict=True):
        assert status == 200, body
        assert token_ids(body) == tokens
