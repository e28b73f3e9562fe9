"""A scripted OpenAI-compatible completions server: the generator's test double.

It streams `max_tokens` tokens with fixed delays (a first-token delay that grows
with the prompt, its token ids or the words of its text, then a fixed gap),
optionally several tokens per chunk, and refuses prompts above a length with HTTP
400, as a real server refuses a prompt longer than its context. With zero delays
it streams as fast as it can, which measures how many tokens per second the
generator can record.

`python -m pdserve.workers.bench.fake_server --port 0` prints its URL and serves
until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class FakeServerSpec:
    """How the fake server answers."""

    model: str = "fake-model"
    ttft_s: float = 0.0
    prefill_s_per_token: float = 0.0
    itl_s: float = 0.0
    tokens_per_chunk: int = 1
    max_prompt_tokens: int | None = None


def make_app(spec: FakeServerSpec) -> web.Application:
    """The aiohttp application serving `/v1/models`, `/v1/completions` and `/health`
    (which routers poll before they send a worker traffic)."""
    app = web.Application()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": spec.model}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _complete(spec, request)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


def _bad_request(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
    return web.json_response(body, status=400)


async def _complete(spec: FakeServerSpec, request: web.Request) -> web.StreamResponse:
    body: Any = await request.json()
    prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
    prompt_tokens = _prompt_tokens(prompt)
    if prompt_tokens is None or not isinstance(max_tokens, int) or max_tokens < 1:
        return _bad_request(
            "prompt must be text or a list of token ids and max_tokens a positive int"
        )
    if spec.max_prompt_tokens is not None and prompt_tokens > spec.max_prompt_tokens:
        return _bad_request(
            f"prompt has {prompt_tokens} tokens, more than the {spec.max_prompt_tokens} allowed"
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await _stream(spec, response, prompt_tokens, max_tokens)
    return response


def _prompt_tokens(prompt: Any) -> int | None:
    """A prompt's length in tokens: its ids, or its words standing in for the tokens
    of a text (this server has no tokenizer); None when it is neither."""
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    return None


async def _stream(
    spec: FakeServerSpec, response: web.StreamResponse, prompt_tokens: int, max_tokens: int
) -> None:
    # Deadlines from one origin, so sleeping late once does not shift every later token.
    first = time.perf_counter() + spec.ttft_s + spec.prefill_s_per_token * prompt_tokens
    sent = 0
    while sent < max_tokens:
        await _sleep_until(first + spec.itl_s * (sent // spec.tokens_per_chunk))
        count = min(spec.tokens_per_chunk, max_tokens - sent)
        sent += count
        await response.write(_chunk(" x" * count, "length" if sent == max_tokens else None))
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": max_tokens,
        "total_tokens": prompt_tokens + max_tokens,
    }
    await response.write(_event({"choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _chunk(text: str, finish_reason: str | None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return _event({"object": "text_completion", "choices": [choice]})


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def start(spec: FakeServerSpec, port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve on 127.0.0.1 (port 0: any free port); returns the runner and the base URL."""
    runner = web.AppRunner(make_app(spec), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{host}:{bound_port}"


async def _serve_forever(spec: FakeServerSpec, port: int) -> None:
    runner, url = await start(spec, port)
    print(url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fake server from the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--max-prompt-tokens", type=int)
    args = parser.parse_args(argv)
    spec = FakeServerSpec(
        ttft_s=args.ttft_ms / 1000,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        itl_s=args.itl_ms / 1000,
        tokens_per_chunk=args.tokens_per_chunk,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(spec, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
