"""`pdserve bench` from the command line: table, JSON and plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.workers.bench import cli
from pdserve.workers.bench.fake_server import FakeServerSpec, start

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """A fake server on its own event loop thread (the command runs its own loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    spec = FakeServerSpec(
        model="tiny", ttft_s=0.01, prefill_s_per_token=2e-6, itl_s=0.002, max_prompt_tokens=2000
    )
    runner, url = asyncio.run_coroutine_threadsafe(start(spec), loop).result(10)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    code: int = args.handler(args)
    return code


def test_bench_writes_table_json_and_plot(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = bench(
        [
            "--url",
            server_url,
            "--workload",
            "mixed",
            "--rate",
            "40",
            "--num-requests",
            "30",
            "--seed",
            "2",
            "--max-output-tokens",
            "20",
            "--slo-ttft-ms",
            "1000",
            "--slo-itl-ms",
            "500",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "model tiny" in printed
    for row in ("TTFT", "ITL", "TPOT", "E2E", "P99", "per input-length bucket", "goodput"):
        assert row in printed
    report = json.loads(out_json.read_text())
    assert report["config"]["workload"] == "mixed"
    assert report["overall"]["requests"] == 30 == len(report["requests"])
    failed = [r for r in report["requests"] if not r["ok"]]
    # Prompts over 2000 tokens are refused by the server, and reported as such.
    assert len(failed) == 2  # seed 2 draws two prompts over the limit
    assert all(r["input_tokens"] > 2000 and r["status"] == 400 for r in failed)
    assert report["overall"]["failed"] == len(failed)
    assert set(report["buckets"]) == {"<=256", "<=1024", "<=4096", ">4096"}
    assert report["overall"]["itl"]["p99"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_misuse_gets_a_message_not_a_traceback(
    server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench(["--url", server_url, "--workload", "chat", "--burstiness", "3"])
    assert code == 2
    assert "gamma" in capsys.readouterr().err
    trace = bench(["--url", server_url, "--trace", "x.csv", "--rate", "3"])
    assert trace == 2
    assert "--rate do not apply to trace replay" in capsys.readouterr().err


def test_both_workload_and_trace_is_refused(server_url: str) -> None:
    with pytest.raises(SystemExit):
        bench(["--url", server_url, "--workload", "chat", "--trace", "x.csv"])
