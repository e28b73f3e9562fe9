"""Every request the router routes is counted once in `pdserve_router_decisions_total`
and under exactly one outcome of `pdserve_router_requests_total`, however it ends:
answered, refused, failed, or left by its client at any stage (before the answer's
headers, after them but before the first token, mid-stream, after the end). The
workers are scripted: each holds its request at the stage the test names until the
client has gone, so every cancel lands where the test says, on any machine, in both
routing modes. A client leaving is logged as such, never as an error."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from pdserve.base.process import ServerProcess
from support import fake_worker
from support.fake_worker import FakeWorker
from support.router import BOUNDARY, router_metric, running_router

SHORT = [5, 6, 7]  # colocated
LONG = list(range(10, 11 + BOUNDARY))  # disaggregated
BUCKETS = {"le64": ("colocated", SHORT), "gt64": ("disaggregated", LONG)}


@dataclass(frozen=True)
class Case:
    """A request: what the worker does with it, whether it streams, how many `data:`
    events its client reads before it leaves (None: it leaves only once the worker
    holds the request, having read nothing; -1: it reads everything and stays), and
    the outcome the router must count."""

    script: str
    stream: bool
    reads: int | None
    outcome: str


CASES = (
    Case(fake_worker.OK, True, -1, "ok"),
    Case(fake_worker.OK, False, -1, "ok"),
    Case(fake_worker.INVALID, False, -1, "invalid"),
    Case(fake_worker.FAILING, True, -1, "error"),
    # The client leaves before the answer's headers, streamed or not.
    Case(fake_worker.HOLD_HEADERS, True, None, "cancelled"),
    Case(fake_worker.HOLD_HEADERS, False, None, "cancelled"),
    # ... once it has the headers and an event, but no token yet.
    Case(fake_worker.HOLD_FIRST_TOKEN, True, 1, "cancelled"),
    # ... mid-stream.
    Case(fake_worker.HOLD_MID_STREAM, True, fake_worker.TOKENS_BEFORE_HOLD, "cancelled"),
    # ... once it has read [DONE], before the worker closed its stream: answered.
    Case(fake_worker.HOLD_AFTER_DONE, True, fake_worker.TOKENS + 1, "ok"),
    Case(fake_worker.OK, True, -1, "ok"),  # the worker is still chosen after all that
)


@contextlib.contextmanager
def router_over(
    decode: str, prefill: str, model_dir: Path, folder: Path
) -> Iterator[ServerProcess]:
    """A router process over the fake workers: short prompts colocated, long ones
    disaggregated."""
    table = {
        "pool": "scripted",
        "model": {"name": "small", "path": str(model_dir)},
        "buckets": [{"maxInputTokens": BOUNDARY, "mode": "colocated"}, {"mode": "disaggregated"}],
        "discovery": {"kind": "static", "decode": [decode], "prefill": [prefill]},
    }
    routing = folder / "routing.json"
    routing.write_text(json.dumps(table))
    with running_router(routing, folder / "router.log") as router:
        yield router


@contextlib.asynccontextmanager
async def scripted_pool(
    model_dir: Path, folder: Path
) -> AsyncIterator[tuple[ServerProcess, FakeWorker]]:
    """A ready router over scripted decode and prefill workers; it and the decode worker."""
    decode, prefill = FakeWorker(), FakeWorker()
    async with decode.serving() as decode_url, prefill.serving() as prefill_url:
        with router_over(decode_url, prefill_url, model_dir, folder) as router:
            await asyncio.to_thread(router.wait_ready)
            yield router, decode


async def ask(url: str, prompt: list[int], case: Case, read: asyncio.Event) -> int:
    """Send the case's request and read what it says; `read` is set once done. The
    answer's status."""
    body = {"prompt": prompt, "max_tokens": 3, "stream": case.stream, "user": case.script}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as answer,
    ):
        if case.reads is not None and case.reads >= 0:
            events = 0
            while events < case.reads:
                line = await answer.content.readline()
                assert line, "the stream ended early"
                events += line.startswith(b"data:")
        elif case.reads == -1:
            await answer.read()
        read.set()
        if case.reads is not None and case.reads >= 0:
            await asyncio.Event().wait()  # stays until the test makes it leave
        return answer.status


async def run_case(
    router: ServerProcess, worker: FakeWorker, prompt: list[int], case: Case
) -> None:
    read = asyncio.Event()
    client = asyncio.create_task(ask(router.url, prompt, case, read))
    if case.reads == -1:
        await asyncio.wait_for(client, 60)
        return
    assert await worker.held() == case.script
    if case.reads is not None:
        await asyncio.wait_for(read.wait(), 60)
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client


async def counted(router: ServerProcess, bucket: str, outcome: str | None = None) -> float:
    name = "pdserve_router_requests_total"
    labels = {"bucket": bucket} | ({"outcome": outcome} if outcome else {})
    return await asyncio.to_thread(router_metric, router, name, **labels)


async def settled(router: ServerProcess, bucket: str, expected: float) -> None:
    """Wait until the router has counted `expected` outcomes in `bucket` (a cancel is
    counted once the router has seen its client leave)."""
    for _ in range(600):
        if await counted(router, bucket) >= expected:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{bucket}: {await counted(router, bucket)} outcomes, not {expected}")


@pytest.mark.timeout(300)
async def test_every_routed_request_has_exactly_one_outcome(
    small_model_dir: Path, tmp_path: Path
) -> None:
    async with scripted_pool(small_model_dir, tmp_path) as (router, decode):
        for bucket, (mode, prompt) in BUCKETS.items():
            for done, case in enumerate(CASES, start=1):
                await run_case(router, decode, prompt, case)
                await settled(router, bucket, done)
            assert decode.modes[-1] == mode
            decisions = await asyncio.to_thread(
                router_metric, router, "pdserve_router_decisions_total", bucket=bucket
            )
            assert decisions == await counted(router, bucket) == len(CASES)
            for outcome in ("ok", "invalid", "error", "cancelled"):
                expected = sum(case.outcome == outcome for case in CASES)
                assert await counted(router, bucket, outcome) == expected, (bucket, outcome)
            served = await asyncio.to_thread(
                router_metric, router, "pdserve_router_requests_total", mode=mode
            )
            assert served == len(CASES), mode
        log = router.log()
    assert " ERROR " not in log and "Traceback" not in log, log
    assert log.count("the client went away") >= 2 * 4, log


@pytest.mark.timeout(300)
async def test_streams_in_a_row_come_whole_over_one_kept_connection_to_the_worker(
    small_model_dir: Path, tmp_path: Path
) -> None:
    async with scripted_pool(small_model_dir, tmp_path) as (router, decode):
        body = {"prompt": SHORT, "max_tokens": 3, "stream": True}
        async with aiohttp.ClientSession() as session:
            for _ in range(5):
                async with session.post(f"{router.url}/v1/completions", json=body) as answer:
                    events = [line async for line in answer.content if line.startswith(b"data:")]
                assert len(events) == fake_worker.TOKENS + 1
                assert events[-1] == b"data: [DONE]\n"
        await settled(router, "le64", 5)
    # The client has a stream whole at its [DONE]; the router may still be reading the
    # worker's end of it when the next request comes, which then takes a second one.
    assert len(decode.peers) == 5 and len(set(decode.peers)) <= 2, decode.peers
