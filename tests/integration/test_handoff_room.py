"""A hand-off that finds the decode worker's KV cache taken by a running answer waits
for that answer to free its blocks, then is handed off, rather than prefilling its
prompt on the decode worker beside the answer (real workers over NIXL)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.faults import Fault, environment
from support.engine import make_engine, run_to_completion
from support.pd import complete, internal_headers, pd_workers, token_ids
from support.worker import metric

BLOCK = 16
CACHE_BLOCKS = 40  # 640 tokens
# The running answer holds its prompt's blocks from its first token on (26), up to 33
# as it grows, until it ends; the handed-off prompt needs 19. Every decode step stalls
# 20 ms, so the answer runs for 2.4 s or more whatever the machine's speed: the hand-off
# certainly finds no room at first. It may wait a minute (not the default 10 s), so that
# a slow machine's longer answer does not end the wait first.
RUNNING_PROMPT, RUNNING_TOKENS = 400, 120
ROOM_WAIT_S = 60
HANDED_PROMPT, MAX_TOKENS = 300, 8
STEP_STALL = {"engine.step": Fault(delay_s=0.02)}


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


async def first_token_then_rest(session: aiohttp.ClientSession, url: str) -> asyncio.Task[int]:
    """Stream the long answer from the decode worker (colocated); return once its first
    token arrived, with a task that reads the rest (its status)."""
    body = {
        "prompt": prompt_of(RUNNING_PROMPT, 1), "max_tokens": RUNNING_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    answer = await session.post(f"{url}/v1/completions", json=body, headers=internal_headers(url))
    assert answer.status == 200
    await answer.content.readline()  # the first event: the answer is running

    async def rest() -> int:
        async with answer:
            await answer.read()
        return answer.status

    return asyncio.ensure_future(rest())


def test_a_hand_off_waits_for_a_running_answer_to_free_the_blocks_it_needs(
    small_model_dir: Path, tmp_path: Path
) -> None:
    prompt = prompt_of(HANDED_PROMPT, 2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected, _ = run_to_completion(make_engine(small_model_dir), [prompt], params)
    decode_args = ["--block-size", str(BLOCK), "--num-kv-blocks", str(CACHE_BLOCKS)]
    decode_args += ["--handoff-room-wait", str(ROOM_WAIT_S)]
    with pd_workers(
        small_model_dir, tmp_path, "nixl", decode_args=decode_args,
        decode_env=environment(STEP_STALL),
    ) as pair:  # fmt: skip
        decode, prefill = pair.decode[0], pair.prefill[0]

        async def scenario() -> tuple[int, dict[str, object], int]:
            async with aiohttp.ClientSession() as session:
                # One hand-off first, so the pair is connected before the race.
                warm, _ = await complete(session, decode.url, prompt_of(40, 3), prefill.url)
                assert warm == 200
                running = await first_token_then_rest(session, decode.url)
                status, answer = await complete(
                    session, decode.url, prompt, prefill.url, max_tokens=MAX_TOKENS
                )
                return status, answer, await running

        status, answer, running_status = asyncio.run(scenario())

        assert (status, running_status) == (200, 200)
        assert token_ids(answer) == expected[0]
        # It waited for room once, and was handed off: no fallback to prefilling here.
        assert metric(decode, "pdserve_kv_room_wait_seconds_count") == 1
        assert metric(decode, "pdserve_kv_transfer_failures_total") == 0
        assert metric(decode, "pdserve_kv_wait_seconds_count") == 2  # both hand-offs
