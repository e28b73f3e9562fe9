"""A request's outputs on their way to a consumer that may not take them: bounded in
generated tokens; past the bound what it held is dropped, the request's abort is
asked for once, and the consumer learns why when it comes back."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.workers.engine.output_buffer import OutputBuffer, StreamOverflowError
from pdserve.workers.engine.stats import RequestOutput


def output(tokens: int, index: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id="r", new_token_ids=tuple(range(tokens)), finished=False, finish_reason=None,
        num_prompt_tokens=4, num_output_tokens=tokens, num_cached_tokens=0, time=0.0,
        index=index,
    )  # fmt: skip


def test_outputs_within_the_bound_reach_the_consumer_in_order() -> None:
    async def run() -> None:
        overflows: list[None] = []
        buffer = OutputBuffer(4, lambda: overflows.append(None))
        sent = [output(1, index) for index in range(4)]
        for item in sent:
            buffer.put(item)
        assert buffer.tokens == 4
        assert [await buffer.get() for _ in sent] == sent
        assert buffer.tokens == 0
        buffer.put(output(4))  # taken ones no longer count
        assert (buffer.tokens, overflows) == (4, [])

    asyncio.run(run())


def test_past_the_bound_the_buffer_empties_and_asks_for_the_abort_once() -> None:
    async def run() -> None:
        overflows: list[None] = []
        buffer = OutputBuffer(4, lambda: overflows.append(None))
        for _ in range(3):
            buffer.put(output(2))  # the third makes 6 > 4
        buffer.put(output(2))  # outputs still in flight when the abort lands
        buffer.put(RuntimeError("late"))
        assert overflows == [None]
        assert (buffer.overflowed, buffer.tokens) == (True, 0)
        error = await buffer.get()
        assert isinstance(error, StreamOverflowError)
        assert "4 tokens" in str(error)
        with pytest.raises(TimeoutError):  # nothing else was kept
            await asyncio.wait_for(buffer.get(), 0.01)

    asyncio.run(run())


def test_without_a_bound_everything_is_kept() -> None:
    async def run() -> None:
        buffer = OutputBuffer(None, lambda: pytest.fail("no bound, no overflow"))
        for _ in range(1000):
            buffer.put(output(16))
        assert buffer.tokens == 16000

    asyncio.run(run())
