"""Property-based fuzzing of a real worker: requests generated (hypothesis) from the
request schemas the worker publishes at /openapi.json, and mutations of them (any
field replaced by any JSON value, numbers at the extremes of float64 and float32 as
numbers and as strings, broken bodies), across the four POST endpoints, streamed and
not.

The property: no request gets a 5xx; the worker's probes keep answering while it
runs; afterwards its KV cache is empty and it holds no more threads or open files
than before."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.background import Background
from support.waiting import wait_until
from support.worker import ServerProcess, metric, running_worker

REQUESTS = 10_000
BATCH = 25  # bodies per generated example
MUTANTS = 4  # cheap mutations sent beside each generated body
MAX_TOKENS = 6  # generated requests are cut to this, so the run stays short
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")

pytestmark = [pytest.mark.timeout(1800), pytest.mark.starts_first]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # A request without max_tokens generates to the end of the context: a short context
    # keeps 10,000 requests cheap (half the CPU of 512) while every path still runs.
    args = ("--served-model-name", "small", "--max-model-len", "128", "--max-num-seqs", "32")
    with running_worker(small_model_dir, tmp_path_factory.mktemp("logs"), *args) as process:
        yield process


def request_schemas(url: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each endpoint's request body schema from /openapi.json, and the named schemas
    they refer to."""
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=10) as answer:
        spec = json.load(answer)
    schemas = {
        path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for path in ENDPOINTS
    }
    return schemas, spec["components"]["schemas"]


def from_schema(schema: dict[str, Any], named: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that follow a JSON schema's types and bounds (the parts pydantic writes:
    $ref, anyOf, enum/const, objects, arrays, strings, numbers, booleans, null), now
    and then with a bound crossed."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(named[schema["$ref"].rsplit("/", 1)[1]], named))
    if "anyOf" in schema:
        return st.one_of(*(from_schema(option, named) for option in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, named) for k, v in properties.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}), named)
        return st.lists(items, min_size=schema.get("minLength", 0), max_size=6)
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        near = st.integers(-1 if low is None else low - 1, 12 if high is None else min(high, 64))
        return near | st.integers()
    if kind == "number":
        return st.floats(-1.0, 3.0) | st.floats() | st.sampled_from(EXTREMES)
    if kind == "string":
        return st.text(max_size=40) | st.sampled_from(["small", "hello world", "</s>"])
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def requests(
    schemas: dict[str, dict[str, Any]], named: dict[str, Any]
) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body): bodies that follow the schema, bodies with a field replaced by
    any JSON value, and broken bytes."""
    bodies = st.one_of(
        *(st.tuples(st.just(path), from_schema(schemas[path], named)) for path in ENDPOINTS)
    )

    @st.composite
    def mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
        path, body = draw(bodies)
        if body and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(body)))
            body[key] = draw(JSON)
        else:
            body[draw(st.sampled_from(["max_tokens", "stop", "messages", "prompt", "n"]))] = draw(
                JSON
            )
        return path, body

    def encoded(item: tuple[str, dict[str, Any]], stream: bool) -> tuple[str, bytes]:
        path, body = item
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        body.setdefault("stream", stream)
        return path, json.dumps(body).encode()

    garbage = st.tuples(st.sampled_from(ENDPOINTS), st.binary(max_size=64))
    return st.one_of(
        st.builds(encoded, bodies, st.booleans()),
        st.builds(encoded, mutated(), st.booleans()),
        garbage,
    )


def mutants(path: str, data: bytes, count: int) -> list[tuple[str, bytes]]:
    """`count` cheap variations of a generated request (seeded by it, so a run is
    reproducible): a field dropped, retyped, or set to a value from the edges of the
    schema; truncated bytes."""
    rng = random.Random(data)
    try:
        body = json.loads(data)
    except ValueError:
        return [(path, data[: rng.randrange(len(data) + 1)]) for _ in range(count)]
    out = []
    for _ in range(count):
        variant = dict(body) if isinstance(body, dict) else {"prompt": body}
        key = rng.choice([*variant, *EDGE_VALUES])
        if key in variant and rng.random() < 0.3:
            del variant[key]
        else:
            variant[key] = rng.choice(EDGE_VALUES.get(key, ()) or EDGE_JSON)
        if rng.random() < 0.1:
            out.append((path, json.dumps(variant).encode()[: rng.randrange(8, 200)]))
        else:
            out.append((path, json.dumps(variant).encode()))
    return out


# Numbers at the extremes of float64 and float32 (subnormals, values that round to 0 or
# overflow in float32, signed zero, NaN and the infinities), as JSON numbers (Python's
# encoder writes NaN and Infinity, as many clients' do) and as strings.
EXTREME_NUMBERS: list[float] = [
    5e-324, 1e-310, 1e-300, 1e-46, 1.4e-45, 1e-40, 1e-38, 1e-6, -0.0, 3.4e38, 3.5e38, 1e300,
    1.7976931348623157e308, -1e300, float("nan"), float("inf"), float("-inf"),
]  # fmt: skip
EXTREMES: list[Any] = [
    *EXTREME_NUMBERS,
    *(repr(value) for value in EXTREME_NUMBERS),
    "NaN", "Infinity", "-Infinity",
]  # fmt: skip
EDGE_JSON: list[Any] = [
    None, True, 0, -1, 2**64, 1e308, "", "x" * 300, [], {}, [[[]]], "\u0000", *EXTREMES,
]  # fmt: skip
EDGE_VALUES: dict[str, list[Any]] = {
    "max_tokens": [0, 1, MAX_TOKENS, -5, 2**63, "3", None, 1e300, 2.0, float("nan")],
    "min_tokens": [0, 1, MAX_TOKENS, MAX_TOKENS + 1, -1, 1e-300, float("inf")],
    "temperature": [0, 0.5, 2.0, -0.1, 101, "hot", *EXTREMES],
    "top_p": [0, 0.01, 1.0, 1.5, *EXTREMES],
    "presence_penalty": [0, -0.0, 0.5, *EXTREMES],
    "frequency_penalty": [0, -0.0, 0.5, *EXTREMES],
    "top_k": [-1, 0, 1, 5, 10**12, 1e300, -0.0, float("nan")],
    "seed": [0, 7, -1, 2**63, 2**64, 1e300, 5e-324, float("inf")],
    "stop": [["a"], [""], ["x" * 300], ["s"] * 20, "the", 5],
    "stop_token_ids": [[0], [1, 2], [10**9], list(range(300)), ["a"]],
    "prompt": ["hello", "", [1, 2, 3], [10**9], [[1, 2]], [["a"]], ["one", "two"], "\ud7ff"],
    "messages": [[], [{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]],
    "n": [1, 2, 0, 16, 17, 2**63, 1e300, float("nan")],
    "logprobs": [None, False, 0, 1, True, 20, 21, -1, 1e-300, float("inf")],
    "top_logprobs": [None, 0, 2, 20, 21, -1, 1e300, float("-inf")],
    "tokens": [[], [1, 2, 3], [10**9], [-1], "abc"],
    "stream": [True, False, "yes"],
    "stream_options": [{"include_usage": True}, {"include_usage": 1}, []],
    "echo": [False, True],
    "add_generation_prompt": [True, False],
    "return_token_strs": [True, False],
    "ignore_eos": [True, False],
}


class Prober(Background):
    """Asks /health every 20 ms on a thread of its own, recording each latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures = 0
        super().__init__("prober")

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=10) as answer:
                    ok = answer.status == 200
            except OSError:
                ok = False
            self.latencies.append(time.perf_counter() - started)
            self.failures += not ok

    def p99_ms(self) -> float:
        return 1000 * statistics.quantiles(self.latencies, n=100)[98]


def process_resources(pid: int) -> tuple[int, int]:
    """(threads, open files) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("Threads"))
    )
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def test_fuzzed_requests_never_get_a_5xx(worker: ServerProcess) -> None:
    schemas, named = request_schemas(worker.url)
    statuses: Counter[int] = Counter()
    failures: list[tuple[int, bytes, str]] = []
    before = process_resources(worker.process.pid)

    async def send_all(batch: list[tuple[str, bytes]]) -> None:
        headers = {"Content-Type": "application/json"}
        # No client deadline: on a loaded machine a batch may queue for minutes behind
        # the worker's generation; the test's own timeout bounds it.
        unbounded = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=unbounded) as session:

            async def one(path: str, data: bytes) -> None:
                async with session.post(f"{worker.url}{path}", data=data, headers=headers) as r:
                    text = await r.text()
                    statuses[r.status] += 1
                    # A stream that started and then broke is a server failure too.
                    if r.status >= 500 or (r.status == 200 and 'data: {"error"' in text):
                        failures.append((r.status, data, text[:300]))

            await asyncio.gather(*(one(path, data) for path, data in batch))

    @settings(
        max_examples=REQUESTS // (BATCH * (1 + MUTANTS)) + 4,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(requests(schemas, named), min_size=BATCH, max_size=BATCH))
    def fuzz(batch: list[tuple[str, bytes]]) -> None:
        expanded = [
            item for path, data in batch for item in [(path, data), *mutants(path, data, MUTANTS)]
        ]
        asyncio.run(send_all(expanded))
        assert not failures, failures[:3]

    with Prober(worker.url) as prober:
        fuzz()
    sent = sum(statuses.values())
    print(f"fuzz: {sent} requests, statuses {dict(sorted(statuses.items()))}")
    print(f"/health during the run: P99 {prober.p99_ms():.1f} ms over {len(prober.latencies)}")
    assert sent >= REQUESTS
    assert not [status for status in statuses if status >= 500]
    assert statuses[200] > sent // 10  # the generator reaches the engine, not only the parser
    assert prober.failures == 0
    wait_until(lambda: metric(worker, "pdserve_kv_cache_usage_ratio") == 0.0, 60, "an empty cache")
    threads, files = wait_until(
        lambda: (now := process_resources(worker.process.pid))[1] <= before[1] + 4 and now,
        60,
        f"open files back to {before[1]}",
    )
    print(f"threads {before[0]} -> {threads}, open files {before[1]} -> {files}")
    assert threads <= before[0] + 2
