"""Prefill/decode disaggregation between real worker processes, for both transfer
backends: token-identical outputs, concurrency, and faults that must neither leak
KV blocks nor leave a client waiting past the deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.faults import Fault
from pdserve.workers.model.identity import weights_digest
from pdserve.workers.server.process import ServerProcess, start_worker
from support.engine import make_engine, run_to_completion
from support.pd import (
    PDPair,
    complete,
    internal_headers,
    join_pool,
    name_peers,
    pd_workers,
    peers_file,
    pool_credential,
    token_ids,
)
from support.worker import metric

BACKENDS = ["nixl", "torch"]
BLOCK = 16
PREFILL_BUDGET = 64  # prompts longer than this are prefilled in several chunks
MAX_TOKENS = 8


def prompts_of_varied_lengths() -> list[list[int]]:
    """50 prompts: 1 token, exactly a block, a block and one, many blocks, longer
    than the prefill token budget."""
    generator = torch.Generator().manual_seed(21)
    lengths = [1, BLOCK, BLOCK + 1, 2 * BLOCK, PREFILL_BUDGET + 1, 5 * BLOCK + 3, 300, 2]
    lengths += torch.randint(1, 400, (50 - len(lengths),), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def expected(small_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Colocated greedy outputs of every prompt, from the engine in this process."""
    prompts = prompts_of_varied_lengths()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs, _ = run_to_completion(make_engine(small_model_dir), prompts, params)
    return {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}


@pytest.fixture(scope="module")
def long_prompt(small_model_dir: Path) -> tuple[list[int], list[int]]:
    """A prompt that a prefill worker with a tiny token budget takes seconds over,
    and its colocated greedy output."""
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 1000, (1000,), generator=generator).tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs, _ = run_to_completion(make_engine(small_model_dir), [prompt], params)
    return prompt, outputs[0]


# The prefill worker stalls after computing the prompt, holding its blocks, before it
# writes them: a hand-off is certainly under way while the stall lasts, however fast
# the machine is.
def stall_before_write(seconds: float) -> dict[str, Fault]:
    return {"prefill.before_write": Fault(delay_s=seconds)}


@pytest.fixture(scope="module", params=BACKENDS)
def pair(
    request: pytest.FixtureRequest, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    budget = ["--max-num-batched-tokens", str(PREFILL_BUDGET)]
    with pd_workers(small_model_dir, logs, request.param, prefill_args=budget) as workers:
        yield workers


def kv_usage(worker: ServerProcess) -> float:
    return metric(worker, "pdserve_kv_cache_usage_ratio")


def wait_for(condition: object, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


async def request_while_killing(
    victim: ServerProcess, decode: ServerProcess, prefill: ServerProcess, prompt: list[int]
) -> tuple[bool, tuple[int, dict[str, object]] | aiohttp.ClientError]:
    """Send a hand-off, kill `victim` while the prefill is under way; whether the
    prefill was under way at the kill, and the answer (or the client's error)."""
    async with aiohttp.ClientSession() as session:
        call = asyncio.ensure_future(complete(session, decode.url, prompt, prefill.url))
        deadline = time.monotonic() + 15
        while not (under_way := kv_usage(prefill) > 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(victim.process.pid, signal.SIGKILL)
        try:
            return under_way, await call
        except aiohttp.ClientError as error:
            return under_way, error


def test_disaggregated_output_is_token_identical(
    pair: PDPair, expected: dict[tuple[int, ...], list[int]]
) -> None:
    decode, prefill = pair.decode[0], pair.prefill[0]

    async def all_prompts() -> list[tuple[int, dict[str, object]]]:
        async with aiohttp.ClientSession() as session:
            return [await complete(session, decode.url, p, prefill.url) for p in expected]

    answers = asyncio.run(all_prompts())
    for (status, answer), (prompt, tokens) in zip(answers, expected.items(), strict=True):
        assert status == 200, answer
        assert token_ids(answer) == tokens, f"prompt of {len(prompt)} tokens"
    assert metric(decode, "pdserve_kv_transfer_failures_total") == 0
    assert metric(prefill, "pdserve_kv_transfer_bytes_total") > 0
    assert metric(decode, "pdserve_time_to_first_token_seconds_count", mode="disaggregated") >= 50
    assert wait_for(lambda: kv_usage(prefill) == 0.0)


def test_prefix_cached_on_decode_side_is_not_sent_again(
    pair: PDPair, small_model_dir: Path
) -> None:
    decode, prefill = pair.decode[0], pair.prefill[0]
    generator = torch.Generator().manual_seed(99)
    prompt = torch.randint(3, 1000, (10 * BLOCK + 5,), generator=generator).tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    colocated = run_to_completion(make_engine(small_model_dir), [prompt], params)[0][0]

    def sent_by(call: object) -> tuple[list[int], float]:
        before = metric(prefill, "pdserve_kv_transfer_bytes_total")

        async def one() -> tuple[int, dict[str, object]]:
            async with aiohttp.ClientSession() as session:
                return await complete(session, decode.url, prompt, prefill.url)

        status, answer = asyncio.run(one())
        assert status == 200, answer
        return token_ids(answer), metric(prefill, "pdserve_kv_transfer_bytes_total") - before

    first, first_bytes = sent_by(None)
    second, second_bytes = sent_by(None)
    assert first == second == colocated
    # 11 blocks the first time; the decode worker then holds the 10 full ones, so the
    # second hand-off moves the partial last block only.
    assert second_bytes == first_bytes / 11


def test_many_handoffs_in_flight_between_two_prefill_and_two_decode(
    small_model_dir: Path,
    tmp_path: Path,
    expected: dict[tuple[int, ...], list[int]],
) -> None:
    backend = "nixl"
    with pd_workers(small_model_dir, tmp_path, backend, prefills=2, decodes=2) as workers:
        prompts = list(expected)[:24]

        async def concurrently() -> list[tuple[int, dict[str, object]]]:
            async with aiohttp.ClientSession() as session:
                calls = [
                    complete(
                        session,
                        workers.decode[index % 2].url,
                        prompt,
                        workers.prefill[(index // 2) % 2].url,
                    )
                    for index, prompt in enumerate(prompts)
                ]
                return list(await asyncio.gather(*calls))

        answers = asyncio.run(concurrently())
        for (status, answer), prompt in zip(answers, prompts, strict=True):
            assert status == 200, answer
            assert token_ids(answer) == expected[prompt]
        for worker in workers.prefill + workers.decode:
            assert wait_for(lambda w=worker: kv_usage(w) == 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_mid_handoff(
    backend: str,
    small_model_dir: Path,
    tmp_path: Path,
    long_prompt: tuple[list[int], list[int]],
) -> None:
    prompt, colocated = long_prompt
    for policy in ("recompute", "fail"):
        # The reserved blocks stay until the lease and its margin are over: a prefill
        # worker that vanished never confirmed that its write stopped.
        decode_args = ["--transfer-failure-policy", policy, "--handoff-timeout", "4"]
        logs = tmp_path / policy
        logs.mkdir()
        with pd_workers(
            small_model_dir, logs, backend, decode_args=decode_args,
            prefill_faults=stall_before_write(60),
        ) as workers:  # fmt: skip
            decode, prefill = workers.decode[0], workers.prefill[0]
            started = time.monotonic()
            under_way, result = asyncio.run(request_while_killing(prefill, decode, prefill, prompt))
            assert under_way
            assert time.monotonic() - started < 20
            assert not isinstance(result, aiohttp.ClientError)
            status, answer = result
            if policy == "recompute":
                assert status == 200 and token_ids(answer) == colocated
            else:
                assert status == 502 and "hand-off failed" in str(answer)
            assert wait_for(lambda d=decode: kv_usage(d) == 0.0, 20)
            assert metric(decode, "pdserve_kv_transfer_failures_total") == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_killed_after_reserving(
    backend: str, small_model_dir: Path, tmp_path: Path, long_prompt: tuple[list[int], list[int]]
) -> None:
    prompt, _ = long_prompt
    # The prefill worker finds its peer gone when the stall ends and frees its blocks.
    prefill_args = ["--handoff-timeout", "10"]
    with pd_workers(
        small_model_dir, tmp_path, backend, prefill_args=prefill_args,
        prefill_faults=stall_before_write(3),
    ) as workers:  # fmt: skip
        decode, prefill = workers.decode[0], workers.prefill[0]
        under_way, result = asyncio.run(request_while_killing(decode, decode, prefill, prompt))
        assert under_way
        assert isinstance(result, aiohttp.ClientError)
        assert wait_for(lambda: kv_usage(prefill) == 0.0, timeout_s=20)
        assert prefill.process.poll() is None


def test_lease_that_expires_frees_both_sides(
    small_model_dir: Path, tmp_path: Path, long_prompt: tuple[list[int], list[int]]
) -> None:
    prompt, _ = long_prompt
    # The prefill worker stalls longer than the decode worker's lease.
    short_lease = ["--handoff-timeout", "0.25", "--transfer-failure-policy", "fail"]
    with pd_workers(
        small_model_dir, tmp_path, "nixl", decode_args=short_lease,
        prefill_faults=stall_before_write(2),
    ) as workers:  # fmt: skip
        decode, prefill = workers.decode[0], workers.prefill[0]

        async def one() -> tuple[int, dict[str, object]]:
            async with aiohttp.ClientSession() as session:
                return await complete(session, decode.url, prompt, prefill.url)

        started = time.monotonic()
        status, answer = asyncio.run(one())
        assert time.monotonic() - started < 5
        assert status == 502 and "lease" in str(answer)
        assert metric(decode, "pdserve_kv_transfer_failures_total", reason="lease_expired") == 1
        assert wait_for(lambda: kv_usage(decode) == 0.0)
        assert wait_for(lambda: kv_usage(prefill) == 0.0)


def test_the_prefill_workers_own_timeout_bounds_its_write(
    small_model_dir: Path, tmp_path: Path
) -> None:
    # The decode worker grants a long lease; the prefill worker allows itself 1 s and
    # stalls longer before its write: it must not write on the caller's word.
    with pd_workers(
        small_model_dir, tmp_path, "nixl",
        prefill_args=["--handoff-timeout", "1"], prefill_faults=stall_before_write(1.5),
        decode_args=["--handoff-timeout", "60", "--transfer-failure-policy", "fail"],
    ) as workers:  # fmt: skip
        decode, prefill = workers.decode[0], workers.prefill[0]

        async def one() -> tuple[int, dict[str, object]]:
            async with aiohttp.ClientSession() as session:
                return await complete(session, decode.url, [5] * 40, prefill.url)

        started = time.monotonic()
        status, answer = asyncio.run(one())
        assert status == 502 and "deadline passed before the write" in str(answer)
        assert time.monotonic() - started < 30  # not the 48 s the lease would allow
        assert metric(decode, "pdserve_kv_transfer_failures_total", reason="lease_expired") == 1
        assert metric(prefill, "pdserve_kv_transfer_bytes_total") == 0
        assert wait_for(lambda: kv_usage(prefill) == 0.0 and kv_usage(decode) == 0.0)


def test_mismatched_handoffs_are_rejected_with_a_reason(pair: PDPair) -> None:
    prefill = pair.prefill[0]

    async def post(body: dict[str, object]) -> tuple[int, dict[str, object]]:
        url = f"{prefill.url}/pd/prefill"
        headers = internal_headers(prefill.url)
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, json=body, headers=headers) as answer,
        ):
            return answer.status, await answer.json()

    sampling: dict[str, object] = {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "min_tokens": 0,
        "stop_token_ids": [], "ignore_eos": True,
    }  # fmt: skip
    unknown_peer = {
        "peer": "nobody", "request_id": "r", "prompt_token_ids": [5] * 40, "sampling": sampling,
        "block_ids": [1, 2, 3], "first_block": 0, "lease_ms": 5000,
    }  # fmt: skip
    status, answer = asyncio.run(post(unknown_peer))
    assert status == 400 and "unknown decode peer" in str(answer)
    status, answer = asyncio.run(post({"peer": "x"}))
    assert status == 400 and "invalid hand-off" in str(answer)
    assert kv_usage(prefill) == 0.0


MISMATCHES = [
    (["--block-size", "32"], ("block_size", "32", "16")),
    (["--kv-cache-dtype", "float16"], ("dtype", "float16", "float32")),
    (["--served-model-name", "other"], ("model", "other", "small")),
]


def test_mismatched_configuration_is_refused_at_connect(
    small_model_dir: Path, other_weights_model_dir: Path, tmp_path: Path
) -> None:
    credential, holds = pool_credential(tmp_path)
    peers, names = peers_file(tmp_path)
    common = ["--threads", "1", "--kv-transfer", "nixl", "--served-model-name", "small", *holds]
    prefill = start_worker(
        small_model_dir, tmp_path / "prefill.log", [*common, "--role", "prefill"]
    )
    # Same shapes, same name, other weights (a rolling update): refused by digest.
    ours, theirs = weights_digest(other_weights_model_dir), weights_digest(small_model_dir)
    cases = [(small_model_dir, args, named) for args, named in MISMATCHES]
    cases.append((other_weights_model_dir, [], ("weights", ours, theirs)))
    decodes = [
        start_worker(
            model_dir,
            tmp_path / f"decode-{index}.log",
            [*common, "--role", "decode", *names, "--transfer-failure-policy", "fail", *args],
        )
        for index, (model_dir, args, _) in enumerate(cases)
    ]
    try:
        name_peers(peers, [prefill])
        for worker in [prefill, *decodes]:
            worker.wait_ready()
        join_pool(credential, prefill, *decodes)

        async def one(decode: ServerProcess) -> tuple[int, dict[str, object]]:
            async with aiohttp.ClientSession() as session:
                return await complete(session, decode.url, [5] * 40, prefill.url)

        for decode, (_, _, named) in zip(decodes, cases, strict=True):
            status, answer = asyncio.run(one(decode))
            assert status == 502
            message = str(answer)
            assert all(word in message for word in named), message
            assert kv_usage(decode) == 0.0
        assert kv_usage(prefill) == 0.0
    finally:
        for worker in [prefill, *decodes]:
            worker.stop()
