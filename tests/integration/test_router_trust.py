"""What the router tells a client, and what it asks of one, as a real `pdserve router`
process: a failure names no worker, `/workers` needs a key as the API does, and the
key file says which keys are valid whenever it is read."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.base.process import ServerProcess
from pdserve.operator import render
from support.network import refusing_url
from support.router import pool_manifest, router_metric, running_router
from support.waiting import wait_until


async def _call(
    method: str, url: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json(content_type=None)


def call(method: str, url: str, body: dict[str, Any] | None = None, key: str | None = None) -> Any:
    return asyncio.run(_call(method, url, body, key))


@contextmanager
def router_of(
    model_dir: Path, folder: Path, decode: list[str], *args: str
) -> Iterator[ServerProcess]:
    """A router whose only decode worker is at `decode` (a static table)."""
    spec = pool_manifest("trust", model_dir, prefill=None,
                         routing={"buckets": [{"mode": "colocated"}]}).spec  # fmt: skip
    table = render.routing_table("trust", "local", spec, {"kind": "static", "decode": decode})
    routing = folder / "routing.json"
    routing.write_text(render.routing_json(table))
    with running_router(routing, folder / "router.log", *args) as router:
        router.wait_ready()
        yield router


def test_a_failure_does_not_tell_the_client_where_the_workers_are(
    small_model_dir: Path, tmp_path: Path
) -> None:
    with refusing_url() as dead, router_of(small_model_dir, tmp_path, [dead]) as router:
        status, answer = call("POST", f"{router.url}/v1/completions", {"prompt": [5, 6]})
        assert status == 503
        assert answer["error"] == {
            "message": "no worker could serve the request", "type": "server_error",
            "param": None, "code": "no_worker_available",
        }  # fmt: skip
        # The worker's address is in the log, for the pool's operator.
        address = dead.removeprefix("http://")
        wait_until(lambda: f"no worker could serve it (worker_unreachable: {dead}" in router.log(),
                   30, "the failure in the router's log")  # fmt: skip
        assert address not in str(answer)


def test_workers_needs_a_key_and_an_emptied_key_file_revokes_every_key(
    small_model_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-first\n")
    with (
        refusing_url() as dead,
        router_of(small_model_dir, tmp_path, [dead], "--api-key-file", str(keys)) as router,
    ):
        # /workers names the workers' internal addresses: a key, as for the API.
        status, answer = call("GET", f"{router.url}/workers")
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        status, answer = call("GET", f"{router.url}/workers", key="sk-first")
        assert status == 200 and [w["url"] for w in answer["decode"]] == [dead]
        # Probes and Prometheus ask none.
        for path in ("/health", "/ready"):
            assert call("GET", f"{router.url}{path}")[0] == 200, path
        assert router_metric(router, "pdserve_router_workers", target="decode") == 1
        assert call("GET", f"{router.url}/v1/models", key="sk-first")[0] == 200

        keys.write_text("")  # every key revoked
        wait_until(
            lambda: call("GET", f"{router.url}/v1/models", key="sk-first")[0] == 401,
            30, "the emptied key file to revoke sk-first",
        )  # fmt: skip
        assert "holds no API key any more" in router.log()
        keys.write_text("sk-second\n")
        wait_until(
            lambda: call("GET", f"{router.url}/v1/models", key="sk-second")[0] == 200,
            30, "the new key to be accepted",
        )  # fmt: skip
        assert call("GET", f"{router.url}/v1/models", key="sk-first")[0] == 401
