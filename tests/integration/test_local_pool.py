"""`pdserve local -f pool.yaml` as a user runs it, and a decode worker dying under it.

The pool: two decode workers behind the router, one request at a time each, slow
engine steps (an injected stall). A long stream holds worker A while a second request
waits there for its first token; then A is killed. The stream A had started ends with
an SSE error event; the request A had not started is retried on worker B. The pool
keeps serving, and Ctrl-C stops every process it started. A bad manifest is refused
with the field named."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from pdserve.base.process import pdserve_command
from pdserve.operator import api
from pdserve.workers.faults import Fault, environment
from support.router import (
    known_workers,
    pool_manifest,
    read_events,
    router_metric,
    stream,
    worker_load,
)
from support.waiting import wait_until


def processes_mentioning(text: str) -> dict[int, str]:
    """Running processes whose command line holds `text`: id -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in command and state not in ("Z", "X"):
            found[int(entry.name)] = command
    return found


class Pool:
    """A `pdserve local` process and what it wrote to its run folder."""

    def __init__(self, local: subprocess.Popen[bytes], run_dir: Path, url: str) -> None:
        self.local = local
        self.run_dir = run_dir
        self.url = url
        self.routing_file = run_dir / "routing.json"
        self.table = json.loads(self.routing_file.read_text())
        self.decode_urls = list(self.table["discovery"]["decode"])

    def worker_pid(self, url: str) -> int:
        """The process of the worker at `url` (it wrote its port to logs/NAME.port)."""
        for port_file in (self.run_dir / "logs").glob("*.port"):
            if url.endswith(f":{int(port_file.read_text())}"):
                (pid,) = processes_mentioning(str(port_file))
                return pid
        raise AssertionError(f"no worker at {url}")

    def route_to(self, *urls: str) -> None:
        """Give the router these decode workers (a new routing file) and wait for it."""
        self.table["discovery"]["decode"] = list(urls)
        self.routing_file.write_text(json.dumps(self.table))
        wanted = sorted(urls)
        wait_until(
            lambda: sorted(w["url"] for w in known_workers(self.url)["decode"]) == wanted,
            30, f"the router to know decode workers {wanted}",
        )  # fmt: skip


def test_a_decode_worker_dies_under_pdserve_local_and_ctrl_c_stops_the_rest(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = pool_manifest(
        "by-hand", small_model_dir, prefill=None,
        decode={"replicas": 2, "engine": {"maxNumBatchedTokens": 64, "maxNumSeqs": 1}},
        routing={"buckets": [{"mode": "colocated"}]},
    )  # fmt: skip
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(yaml.safe_dump(api.dump(pool)))
    run_dir, port_file = tmp_path / "run", tmp_path / "router.port"
    command = pdserve_command(
        "local", "-f", str(manifest), "--port", "0", "--port-file", str(port_file),
        "--run-dir", str(run_dir),
    )  # fmt: skip
    slow_steps = environment({"engine.step": Fault(delay_s=0.05)})
    with (tmp_path / "local.log").open("wb") as log:
        local = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **slow_steps}
        )
    try:
        wait_until(port_file.exists, 300, "the pool to serve")
        running = Pool(local, run_dir, f"http://127.0.0.1:{int(port_file.read_text())}")
        assert len(set(processes_mentioning(str(run_dir))) - {local.pid}) == 3
        (_, error), (status, tokens, waiting_error) = asyncio.run(lose_a_worker(running))
        assert error is not None and error["code"] == "worker_failed"
        assert "the worker serving this stream failed" in error["message"]
        assert (status, waiting_error, len(tokens)) == (200, None, 5)  # served by B
        retried = router_metric(
            running, "pdserve_router_retries_total", reason="worker_unreachable"
        )
        assert retried >= 1
        assert router_metric(running, "pdserve_router_requests_total", outcome="error") == 1
        wait_until(lambda: reported_dead(tmp_path / "local.log"), 60, "the death to be reported")
        os.kill(local.pid, signal.SIGINT)
        assert local.wait(60) == 0
    finally:
        if local.poll() is None:
            local.kill()
    time.sleep(0.5)
    assert processes_mentioning(str(run_dir)) == {}
    output = (tmp_path / "local.log").read_text()
    assert f"serving model small at {running.url}" in output
    assert reported_dead(tmp_path / "local.log")
    assert output.rstrip().endswith("stopped")


def reported_dead(log: Path) -> bool:
    """Whether `pdserve local` has said that one of its decode workers exited."""
    output = log.read_text()
    return "decode-0 exited" in output or "decode-1 exited" in output


async def lose_a_worker(
    pool: Pool,
) -> tuple[tuple[list[int], Any], tuple[int, list[int], Any]]:
    """Kill worker A with one stream under way on it and one request waiting there;
    what both requests' clients got."""
    a, b = pool.decode_urls
    pool.route_to(a)
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with session.post(f"{pool.url}/v1/completions", json=body) as streaming:
            assert streaming.status == 200
            await streaming.content.readline()  # it has started streaming
            waiting = asyncio.ensure_future(stream(session, pool.url, [8, 9], 5))
            while worker_load(a)["in_flight"] < 2:
                await asyncio.sleep(0.05)
            pool.route_to(a, b)
            os.kill(pool.worker_pid(a), signal.SIGKILL)
            broken = await read_events(streaming)
        return broken, await waiting


def test_pdserve_local_refuses_a_bad_manifest_naming_the_field(tmp_path: Path) -> None:
    manifest = tmp_path / "pool.yaml"
    bad = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"name": "m", "path": "/m"}, "image": "i",
                    "decode": {"replicas": -1}}}  # fmt: skip
    manifest.write_text(yaml.safe_dump(bad))
    refused = subprocess.run(
        pdserve_command("local", "-f", str(manifest)), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "spec.decode.replicas" in refused.stderr
