"""The router when a prefill worker dies under load, made deterministic by an injected
stall: no request is lost (they are served colocated, counted as fallbacks). A decode
worker dying is in test_local_pool."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.faults import Fault, environment
from support.engine import make_engine, run_to_completion
from support.router import local_pool, pool_manifest, router_metric, stream, worker_load

MAX_TOKENS = 8


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
