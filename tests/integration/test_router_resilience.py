"""The router when workers die under load, made deterministic by injected stalls:
killing the prefill worker loses no request (they are served colocated, counted as
fallbacks); killing a decode worker sends the requests it had not started streaming
elsewhere, and ends the streams it had started with an SSE error event."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.faults import Fault, environment
from support.engine import make_engine, run_to_completion
from support.router import known_workers, local_pool, pool_manifest, router_metric, worker_load
from support.waiting import wait_until

MAX_TOKENS = 8


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> Any:
    """A streamed greedy completion: (status, token ids, error event or None)."""
    body = {
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return response.status, [], await response.text()
        return (response.status, *await read_events(response))


async def read_events(response: aiohttp.ClientResponse) -> tuple[list[int], Any]:
    ids: list[int] = []
    async for line in response.content:
        data = line.strip().removeprefix(b"data:").strip()
        if not data or data == b"[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            return ids, event["error"]
        ids += event["choices"][0].get("token_ids", [])
    return ids, None


def test_killing_the_prefill_worker_loses_no_request(small_model_dir: Path, tmp_path: Path) -> None:
    # The decode worker fails a broken hand-off (no local retry): the router must
    # serve the request colocated. Each hand-off stalls a second before its KV is
    # written, so some are certainly in flight when the prefill worker dies.
    manifest = pool_manifest(
        "prefill-dies", small_model_dir,
        kvTransfer={"backend": "nixl", "failurePolicy": "fail"},
    )  # fmt: skip
    stall = environment({"prefill.before_write": Fault(delay_s=1.0)})
    prompts = [list(range(10 + i, 110 + i)) for i in range(12)]  # 100 tokens: disaggregated
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected, _ = run_to_completion(make_engine(small_model_dir), prompts, params)
    with local_pool(manifest, tmp_path / "pool", env={"prefill": stall}) as pool:
        prefill = pool.workers["prefill"][0]

        async def under_load() -> list[Any]:
            async with aiohttp.ClientSession() as session:
                first = [
                    asyncio.ensure_future(stream(session, pool.url, p, MAX_TOKENS))
                    for p in prompts[:6]
                ]
                while worker_load(prefill.url)["in_flight"] == 0:
                    await asyncio.sleep(0.05)
                os.kill(prefill.process.pid, signal.SIGKILL)
                later = [stream(session, pool.url, p, MAX_TOKENS) for p in prompts[6:]]
                return list(await asyncio.gather(*first, *later))

        answers = asyncio.run(under_load())
        for (status, tokens, error), want in zip(answers, expected, strict=True):
            assert (status, error) == (200, None)
            assert tokens == want
        fallbacks = router_metric(pool, "pdserve_router_fallbacks_total")
        assert fallbacks >= 6
        assert router_metric(pool, "pdserve_router_fallbacks_total", reason="handoff_failed") >= 1
        # The hand-offs under way when it died failed (502): the router retried them.
        assert router_metric(pool, "pdserve_router_retries_total", reason="handoff_failed") >= 1
        assert router_metric(pool, "pdserve_router_requests_total", outcome="ok") == 12
        assert router_metric(pool, "pdserve_router_requests_total", mode="colocated") >= 6


def test_killing_a_decode_worker(small_model_dir: Path, tmp_path: Path) -> None:
    # Two decode workers, one request at a time each, slow steps: a long stream holds
    # worker A while a second request waits there for its first token.
    manifest = pool_manifest(
        "decode-dies", small_model_dir, prefill=None,
        decode={"replicas": 2, "engine": {"maxNumBatchedTokens": 64, "maxNumSeqs": 1}},
        routing={"buckets": [{"mode": "colocated"}]},
    )  # fmt: skip
    slow = environment({"engine.step": Fault(delay_s=0.05)})
    with local_pool(manifest, tmp_path / "pool", env={"decode": slow}) as pool:
        a, b = pool.workers["decode"]
        table = json.loads(pool.routing_file.read_text())

        def only_decode(*urls: str) -> None:
            table["discovery"]["decode"] = list(urls)
            pool.routing_file.write_text(json.dumps(table))
            wanted = sorted(urls)
            wait_until(
                lambda: sorted(w["url"] for w in known_workers(pool.url)["decode"]) == wanted,
                30, f"the router to know decode workers {wanted}",
            )  # fmt: skip

        async def scenario() -> tuple[Any, Any]:
            only_decode(a.url)
            async with aiohttp.ClientSession() as session:
                body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with session.post(f"{pool.url}/v1/completions", json=body) as streaming:
                    assert streaming.status == 200
                    await streaming.content.readline()  # it has started streaming
                    waiting = asyncio.ensure_future(stream(session, pool.url, [8, 9], 5))
                    while worker_load(a.url)["in_flight"] < 2:
                        await asyncio.sleep(0.05)
                    only_decode(a.url, b.url)
                    os.kill(a.process.pid, signal.SIGKILL)
                    broken = await read_events(streaming)
                return broken, await waiting

        (_, error), (status, tokens, waiting_error) = asyncio.run(scenario())
        assert error is not None and error["code"] == "worker_failed"
        assert "the worker serving this stream failed" in error["message"]
        assert (status, waiting_error, len(tokens)) == (200, None, 5)  # served by b
        assert router_metric(pool, "pdserve_router_retries_total", reason="worker_unreachable") >= 1
        assert router_metric(pool, "pdserve_router_requests_total", outcome="error") == 1
