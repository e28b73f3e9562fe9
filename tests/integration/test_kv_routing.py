"""KV-aware routing with real workers: the router follows each worker's KV event
feed and sends a request where its prompt is cached. A conversation stays with the
worker that holds its history (the router's prediction and the engine's own hit
counter agree); the index is rebuilt after a router or a worker restarts; a worker
with another block size is refused for KV scoring, loudly, and still serves; a
disaggregated request whose first half the decode worker holds moves only the rest."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from pdserve.base.process import ServerProcess, spawn
from pdserve.protocol.headers import LOCAL_PREFILL_HEADER
from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.router.kv_costs import StepCosts
from pdserve.workers.server.process import running_worker, start_worker
from support.conformance import PublishedApi
from support.engine import make_engine, run_to_completion
from support.kv_pool import feeds, kv_router, metric, routing_file, wait_synced
from support.pd import PDPair, complete, pd_workers, run
from support.router import worker_load
from support.waiting import wait_until

BACKEND = "nixl"
BLOCK = 16
MAX_TOKENS = 8
# Prompts of up to this many uncached tokens are served colocated.
BOUNDARY = 64
HITS = "pdserve_prefix_cache_hits_total"
DECISIONS = "pdserve_router_kv_decisions_total"
PREDICTED = "pdserve_router_kv_predicted_hit_tokens_total"
ACTUAL = "pdserve_router_kv_actual_hit_tokens_total"
PREDICTIONS = "pdserve_router_kv_predictions_total"


@pytest.fixture(scope="module")
def workers(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    """Two decode workers and a prefill worker of one pool."""
    log_dir = tmp_path_factory.mktemp("kv-pool")
    with pd_workers(small_model_dir, log_dir, BACKEND, prefills=1, decodes=2) as started:
        yield started


def credential(workers: PDPair) -> Path:
    assert workers.peers is not None
    return workers.peers.parent / f"{BACKEND}-pool.credential"


def random_tokens(seed: int, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (count,), generator=generator).tolist()


@dataclass(frozen=True)
class Turn:
    """One request through the router and what it did."""

    tokens: list[int]
    mode: str
    served_by: str  # the decode worker whose request count rose
    predicted: float  # cached tokens the router predicted on it
    hits: float  # cached tokens its engine found
    reason: str  # the router's KV decision for the decode worker
    actual: float  # cached tokens the router learnt its engine found (from the answer)
    result: str  # how the router's prediction compared with that (exact, over, under)


def send(router: ServerProcess, workers: PDPair, prompt: list[int]) -> Turn:
    """A greedy completion through the router, and who served it with what hits."""
    decodes = [w.url for w in workers.decode]

    def counts() -> dict[str, tuple[float, float]]:
        return {u: (metric(u, "pdserve_requests_total"), metric(u, HITS)) for u in decodes}

    before, reasons_before = counts(), decisions(router)
    predicted_before = metric(router.url, PREDICTED, target="decode")
    actual_before, results_before = metric(router.url, ACTUAL, target="decode"), results(router)
    _, mode, tokens = post(router, prompt, MAX_TOKENS)
    served_before = sum(count for count, _ in before.values())

    def counted() -> dict[str, tuple[float, float]] | None:
        now = counts()
        return now if sum(count for count, _ in now.values()) > served_before else None

    after = wait_until(counted, 30, "the request to be counted by its worker")
    served = next(u for u in decodes if after[u][0] > before[u][0])
    reasons = decisions(router)
    reason = next(r for r in reasons if reasons[r] > reasons_before.get(r, 0))
    predicted = metric(router.url, PREDICTED, target="decode") - predicted_before
    actual = metric(router.url, ACTUAL, target="decode") - actual_before
    outcomes = results(router)
    result = next(r for r in outcomes if outcomes[r] > results_before[r])
    hits = after[served][1] - before[served][1]
    return Turn(tokens, mode, served, predicted, hits, reason, actual, result)


def post(router: ServerProcess, prompt: list[int], max_tokens: int) -> tuple[int, str, list[int]]:
    """A greedy completion through the router: status, mode served and token ids."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        tokens = json.load(answer)["choices"][0]["token_ids"]
        return int(answer.status), answer.headers["X-Pdserve-Mode"], tokens


def decisions(router: ServerProcess) -> dict[str, float]:
    return {
        reason: metric(router.url, DECISIONS, target="decode", reason=reason)
        for reason in ("cache", "load", "none")
    }


def results(router: ServerProcess) -> dict[str, float]:
    return {
        result: metric(router.url, PREDICTIONS, target="decode", result=result)
        for result in ("exact", "over", "under", "unknown")
    }


def conversation(seed: int, turns: int) -> Generator[list[int], list[int], None]:
    """The prompts of a chat: a system prompt, then each turn the whole history (the
    answers as the router gave them) and a new user message. Send each prompt and
    `send` back its answer's tokens."""
    history = random_tokens(seed, 3 * BLOCK + 5)
    for turn in range(turns):
        answer = yield history
        history = history + answer + random_tokens(seed * 100 + turn, 21)


def test_a_conversation_stays_with_the_worker_holding_its_history(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    table = routing_file(tmp_path, small_model_dir, [w.url for w in workers.decode])
    with kv_router(table, credential(workers), tmp_path / "router.log") as router:
        wait_synced(router.url, [w.url for w in workers.decode])
        turns = run_conversation(router, workers, seed=11, count=6)
    first, rest = turns[0], turns[1:]
    assert first.reason == "none" and first.predicted == 0 == first.hits
    moved = [turn for turn in rest if turn.served_by != first.served_by]
    # One exception is allowed, when load forces it and the router says so.
    assert len(moved) <= 1 and all(turn.reason == "load" for turn in moved), turns
    for turn in rest:
        if turn.served_by == first.served_by:
            assert turn.reason == "cache"
            assert turn.predicted > 0
        # The router's prediction is what the engine found, every turn, and the router
        # knows it: the engine's count reaches it with the answer.
        assert turn.predicted == turn.hits == turn.actual and turn.result == "exact", turn
    # Six turns of 8 tokens are more steps than the worker's cost model warms up on:
    # it publishes what its steps cost, in a form the router takes.
    costs = StepCosts.of(worker_load(first.served_by).get("step_costs"))
    assert costs is not None and costs.prefill_token_s + costs.base_s > 0, costs


def run_conversation(router: ServerProcess, workers: PDPair, seed: int, count: int) -> list[Turn]:
    prompts = conversation(seed, count)
    prompt = next(prompts)
    turns = []
    for _ in range(count):
        turn = send(router, workers, prompt)
        turns.append(turn)
        try:
            prompt = prompts.send(turn.tokens)
        except StopIteration:
            break
    return turns


def test_a_restarted_router_rebuilds_its_index_and_routes_as_before(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    table = routing_file(tmp_path, small_model_dir, [w.url for w in workers.decode])
    prompts = conversation(seed=21, turns=4)
    with synced_router(workers, table, tmp_path / "router-1.log") as router:
        first = send(router, workers, next(prompts))
        prompt = prompts.send(first.tokens)
    with synced_router(workers, table, tmp_path / "router-2.log") as router:
        # The new router's index holds what the workers hold: the history is found.
        after = send(router, workers, prompt)
    assert after.served_by == first.served_by
    assert after.reason == "cache" and after.predicted == after.hits > 0


def test_a_restarted_worker_is_read_again_and_its_lost_cache_is_not_predicted(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    decodes = [w.url for w in workers.decode]
    table = routing_file(tmp_path, small_model_dir, decodes)
    prompts = conversation(seed=31, turns=4)
    with synced_router(workers, table, tmp_path / "router.log") as router:
        first = send(router, workers, next(prompts))
        prompt = prompts.send(first.tokens)
        epoch = feeds(router.url)[first.served_by]["epoch"]
        index = decodes.index(first.served_by)
        restart(workers, index, tmp_path)
        wait_until(
            lambda: feeds(router.url)[first.served_by].get("epoch") not in (None, epoch)
            and feeds(router.url)[first.served_by]["state"] == "synced",
            60, "the restarted worker's new epoch in the router's index",
        )  # fmt: skip
        assert metric(router.url, "pdserve_router_kv_resyncs_total", reason="reconnect") >= 1
        # Its cache went with it: no worker is predicted to hold the history ...
        second = send(router, workers, prompt)
        assert second.reason == "none" and second.predicted == 0 == second.hits
        # ... and the conversation stays where it went next.
        third = send(router, workers, prompts.send(second.tokens))
    assert third.served_by == second.served_by
    assert third.reason == "cache" and third.predicted == third.hits > 0


@contextmanager
def synced_router(workers: PDPair, table: Path, log: Path) -> Iterator[ServerProcess]:
    """A router over the decode workers, once its index holds their feeds."""
    with kv_router(table, credential(workers), log) as router:
        wait_synced(router.url, [w.url for w in workers.decode])
        yield router


def restart(workers: PDPair, index: int, log_dir: Path) -> None:
    """Stop a decode worker and start it again on its port (a new process: a new epoch,
    an empty cache)."""
    old = workers.decode[index]
    args = old.process.args
    assert isinstance(args, list)
    old.stop()
    command = [str(a) for a in args[args.index("worker") :]]
    command = [*command[: command.index("--port")], "--port", str(old.port)]
    replacement = spawn(command, log_dir / f"restarted-{index}.log", old.host)
    replacement.wait_ready()
    workers.decode[index] = replacement


@pytest.mark.parametrize(
    ("odd_args", "differs"),
    [
        (["--block-size", str(2 * BLOCK)], "block_size"),
        (["--prefix-caching-hash-seed", "another-pool"], "hash_seed"),
    ],
)
def test_a_worker_with_another_block_size_or_seed_is_refused_for_kv_scoring_and_still_serves(
    workers: PDPair, small_model_dir: Path, tmp_path: Path, odd_args: list[str], differs: str
) -> None:
    own = credential(workers)
    args = [
        "--threads", "1", "--served-model-name", "small", "--internal-token-file", str(own),
        *odd_args,
    ]  # fmt: skip
    with running_worker(small_model_dir, tmp_path / "odd.log", args) as odd_worker:
        odd, usual = odd_worker.url, workers.decode[0].url
        table = routing_file(tmp_path, small_model_dir, [usual, odd])
        with kv_router(table, own, tmp_path / "router.log") as router:
            wait_synced(router.url, [usual])
            state = wait_until(
                lambda: (feeds(router.url).get(odd) or {}).get("state") == "refused"
                and feeds(router.url)[odd],
                60, f"the worker with another {differs} refused",
            )  # fmt: skip
            assert differs in state["reason"]
            failures = "pdserve_router_kv_handshake_failures_total"
            assert metric(router.url, failures, target="decode", reason=differs) == 1
            assert "refused for KV-aware routing" in router.log()
            # The pool serves, the refused worker included (chosen by load alone): eight
            # requests at once, each long enough to be under way when the next is routed,
            # so the usual worker's load, not its learned step cost, decides.
            before = metric(odd, "pdserve_requests_total")
            prompts = [random_tokens(40 + index, 40) for index in range(8)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda prompt: post(router, prompt, 64), prompts))
            assert [status for status, *_ in answers] == [200] * len(prompts)
            assert metric(odd, "pdserve_requests_total") > before


def test_a_handoff_moves_only_the_blocks_the_decode_worker_lacks(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    decodes = [w.url for w in workers.decode]
    prefill = workers.prefill[0].url
    table = routing_file(tmp_path, small_model_dir, decodes, [prefill], boundary=BOUNDARY)
    prompt = random_tokens(51, 20 * BLOCK)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = run_to_completion(make_engine(small_model_dir), [prompt], params)[0][0]
    moved = "pdserve_kv_transfer_bytes_total"
    saved = "pdserve_kv_transfer_saved_bytes_total"
    with kv_router(table, credential(workers), tmp_path / "router.log") as router:
        wait_synced(router.url, [*decodes, prefill])
        half = send(router, workers, prompt[: 10 * BLOCK])
        assert half.mode == "disaggregated"
        wait_until(
            lambda: feeds(router.url)[half.served_by]["blocks"] >= 10, 30,
            "the decode worker's new blocks in the index",
        )  # fmt: skip
        before = metric(prefill, moved), metric(half.served_by, saved)
        whole = send(router, workers, prompt)
        sent = metric(prefill, moved) - before[0]
        not_sent = metric(half.served_by, saved) - before[1]
        # Then a next turn with few new tokens: the decode worker holds the rest, so it
        # is served colocated, though its length alone says disaggregated.
        follow = send(router, workers, prompt + whole.tokens + random_tokens(52, 20))
        by_cache = metric(
            router.url, "pdserve_router_kv_pd_decisions_total",
            by_length="disaggregated", mode="colocated",
        )  # fmt: skip
    assert whole.mode == "disaggregated" and whole.served_by == half.served_by
    assert whole.tokens == expected
    half_bytes = sent  # ten blocks moved: the ten it lacked
    assert not_sent == half_bytes > 0
    assert follow.mode == "colocated" and follow.served_by == half.served_by
    assert by_cache == 1


def test_a_decode_worker_that_holds_a_disaggregated_prompt_but_a_few_tokens_computes_them(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    # The router's index knows nothing (its hash seed is no worker's: every feed is
    # refused), as when it lags behind a worker: by length, the prompt goes through the
    # prefill worker. The decode worker holds all of it but 20 tokens, within what the
    # pool serves colocated: it computes those itself, without a hand-off or a fallback.
    decode, prefill = workers.decode[0].url, workers.prefill[0].url
    table = routing_file(tmp_path, small_model_dir, [decode], [prefill], boundary=BOUNDARY)
    data = json.loads(table.read_text())
    data["routingPolicy"]["hashSeed"] = "no-worker-has-this-seed"
    table.write_text(json.dumps(data))
    history = random_tokens(61, 20 * BLOCK)
    prompt = history + random_tokens(62, 20)
    new = random_tokens(63, 20 * BLOCK)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = run_to_completion(make_engine(small_model_dir), [prompt, new], params)[0]
    with kv_router(table, credential(workers), tmp_path / "router.log") as router:
        wait_until(
            lambda: (feeds(router.url).get(decode) or {}).get("state") == "refused", 60,
            "the decode worker refused for KV scoring",
        )  # fmt: skip
        status, _ = run(decode_directly(decode, history))  # the history, cached there
        assert status == 200
        moved = metric(prefill, "pdserve_kv_transfer_bytes_total")
        _, mode, tokens = post(router, prompt, MAX_TOKENS)
        assert metric(prefill, "pdserve_kv_transfer_bytes_total") == moved
        skipped = metric(router.url, "pdserve_router_handoffs_skipped_total")
        fallbacks = metric(router.url, "pdserve_router_fallbacks_total")
        # A prompt it does not hold is still handed off.
        _, new_mode, new_tokens = post(router, new, MAX_TOKENS)
    assert (mode, tokens) == ("colocated", expected[0])
    assert (skipped, fallbacks) == (1, 0)
    assert metric(decode, "pdserve_kv_handoffs_skipped_total") >= 1
    assert (new_mode, new_tokens) == ("disaggregated", expected[1])
    assert metric(prefill, "pdserve_kv_transfer_bytes_total") > moved


async def decode_directly(decode: str, prompt: list[int]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        return await complete(session, decode, prompt, None, max_tokens=1)


@pytest.mark.parametrize("value", ["-1", "1e3", "+64", "64 tokens", "9" * 5000, str(1 << 40)])
def test_a_decode_worker_refuses_a_local_prefill_bound_that_is_not_a_token_count(
    workers: PDPair, value: str
) -> None:
    decode, prefill = workers.decode[0].url, workers.prefill[0].url

    async def ask() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            bound = {LOCAL_PREFILL_HEADER: value}
            prompt = random_tokens(64, 40)
            return await complete(session, decode, prompt, prefill, extra_headers=bound)

    status, answer = run(ask())
    assert status == 400
    assert LOCAL_PREFILL_HEADER in answer["error"]["message"]


def test_a_router_reading_the_kv_feed_does_not_hold_a_stopping_worker(
    workers: PDPair, small_model_dir: Path, tmp_path: Path
) -> None:
    own = credential(workers)
    args = ["--threads", "1", "--internal-token-file", str(own), "--drain-timeout", "60"]
    worker = start_worker(small_model_dir, tmp_path / "worker.log", args)
    try:
        worker.wait_ready()
        snapshot = feed_get(worker.url, "/pd/kv/snapshot", own)
        query = f"?epoch={snapshot['epoch']}&after={snapshot['seq']}&wait_ms=10000"
        with ThreadPoolExecutor(1) as reader:
            waiting = reader.submit(feed_get, worker.url, "/pd/kv/events" + query, own)
            time.sleep(0.5)  # the read is under way (if not, the test proves less, never fails)
            worker.process.send_signal(signal.SIGTERM)
            assert worker.process.wait(timeout=60) == 0
            with contextlib.suppress(OSError):
                waiting.result()
        assert "request(s) in flight" not in worker.log()
    finally:
        worker.stop()


def feed_get(url: str, path: str, credential_file: Path) -> dict[str, Any]:
    request = urllib.request.Request(
        url + path, headers={"Authorization": f"Bearer {credential_file.read_text().strip()}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        body: dict[str, Any] = json.load(answer)
    return body


def test_the_kv_feed_is_described_in_the_workers_openapi_document(workers: PDPair) -> None:
    """A third party writing its own subscriber finds the feed, its parameters and
    its credential in /openapi.json, and the feed's answers follow the schemas."""
    url = workers.decode[0].url
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as answer:
        published = PublishedApi(json.load(answer))
    paths = published.spec["paths"]
    events = paths["/pd/kv/events"]["get"]
    assert {p["name"] for p in events["parameters"]} == {"epoch", "after", "wait_ms"}
    for path in ("/pd/kv/snapshot", "/pd/kv/events"):
        assert paths[path]["get"]["security"] == [{"poolCredential": []}]
        assert "401" in paths[path]["get"]["responses"]
    snapshot = feed_get(url, "/pd/kv/snapshot", credential(workers))
    published.check("GET", "/pd/kv/snapshot", 200, "application/json", snapshot)
    query = f"?epoch={snapshot['epoch']}&after=0&wait_ms=0"
    found = feed_get(url, "/pd/kv/events" + query, credential(workers))
    published.check("GET", "/pd/kv/events", 200, "application/json", found)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/pd/kv/snapshot", timeout=30)
    assert refused.value.code == 401
    published.check("GET", "/pd/kv/snapshot", 401, "application/json", json.load(refused.value))
