"""KV-aware choice of a worker: its predicted time to first token (uncached and
queued prompt tokens at its own cost per token, the steps' decodes), or uncached
tokens plus a weight per request when the table sets one; ties by load; and the P/D
decision on the tokens the chosen decode worker lacks."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from pdserve.protocol.routing import RoutingTable, Slo, parse_table
from pdserve.workers.engine.kv_events import prefix_hashes
from pdserve.workers.router.kv_costs import DEFAULT_COSTS, StepCosts, drawn_to_peers
from pdserve.workers.router.kv_index import block_key
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.kv_room import BatchRoom
from pdserve.workers.router.kv_scoring import KVPrompt, KVScorer
from pdserve.workers.router.kv_subscriber import Expected, KVFeeds
from pdserve.workers.router.metrics import RouterMetrics
from pdserve.workers.router.proxy import Forwarder, Outstanding
from pdserve.workers.router.routed import Routed
from pdserve.workers.router.upstream import Upstreams
from pdserve.workers.router.workers import PublishedLoad, Worker, WorkerSet

A, B = "http://a:1", "http://b:1"
BLOCK = 16


def table(weight: int | None = 128, policy: str = "kv-aware") -> RoutingTable:
    weighs = "" if weight is None else f', "loadWeightTokens": {weight}'
    raw = (
        '{"pool": "p", "model": {"name": "m", "path": "/m"}, "buckets": ['
        '{"maxInputTokens": 64, "mode": "colocated"}, {"mode": "disaggregated"}],'
        f'"routingPolicy": {{"type": "{policy}", "blockSize": {BLOCK}{weighs}}},'
        '"discovery": {"kind": "static", "decode": ["http://a:1"], "prefill": ["http://p:1"]}}'
    )
    return parse_table(raw.encode())


async def scorer_with(held: dict[str, list[int]], prompt: KVPrompt) -> tuple[KVScorer, WorkerSet]:
    registry = CollectorRegistry()
    metrics = KVRoutingMetrics("p", registry)
    feeds = KVFeeds(aiohttp.ClientSession(), {}, Expected(BLOCK, "m"), metrics)
    await feeds.session.close()
    decode = WorkerSet("decode")
    decode.update(held)
    for url, count in held.items():
        feeds.indexes["decode"].replace(url, prompt.keys[: len(count)], capacity=1000)
    return KVScorer(feeds, metrics), decode


def prompt_of(tokens: int, weight: int | None = 128) -> KVPrompt:
    found = KVPrompt.of(list(range(3, 3 + tokens)), table(weight))
    assert found is not None
    return found


async def test_the_worker_holding_the_prompt_wins_unless_its_load_costs_more() -> None:
    prompt = prompt_of(20 * BLOCK)
    scorer, decode = await scorer_with({A: [0] * 10, B: []}, prompt)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == A
    assert choice.cached_tokens == 10 * BLOCK and choice.reason == "cache"
    # A holds 160 tokens; two requests in flight there cost 2 x 128 = 256 tokens more.
    worker_a = decode.get(A)
    assert worker_a is not None
    worker_a.in_flight = 2
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == B and choice.reason == "load"
    assert choice.cached_tokens == 0


# 1 ms a prompt token, 10 ms a step, 2 ms a decoding request in each step, 256
# tokens a step.
COSTS = StepCosts(base_s=0.01, prefill_token_s=1e-3, prefill_key_s=0.0, decode_token_s=2e-3,
                  step_tokens=256)  # fmt: skip


def publish(decode: WorkerSet, url: str, costs: StepCosts | None, at: float) -> None:
    worker = decode.get(url)
    assert worker is not None
    worker.published = PublishedLoad(at=at, costs=costs)


def load(decode: WorkerSet, url: str, requests: int, waiting_tokens: int) -> None:
    worker = decode.get(url)
    assert worker is not None
    worker.in_flight, worker.prefill_tokens = requests, waiting_tokens


@pytest.mark.parametrize(
    ("requests", "waiting", "chosen", "reason"),
    [
        # A: 16 tokens left, one step with 3 decodes: 16 + 10 + 6 = 32 ms; B: the
        # whole 320 tokens in 2 steps: 320 + 20 = 340 ms.
        (3, 0, A, "cache"),
        # A: 1,016 tokens in 4 steps with 4 decodes: 1016 + 4 x 18 = 1088 ms.
        (4, 1000, B, "load"),
    ],
)
async def test_predicted_time_weighs_a_busy_worker_holding_the_prefix_against_an_idle_one(
    requests: int, waiting: int, chosen: str, reason: str
) -> None:
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    for url in (A, B):
        publish(decode, url, COSTS, scorer._clock())
    load(decode, A, requests, waiting)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen and choice.reason == reason


@pytest.mark.parametrize(("slower", "chosen"), [(1.0, A), (20.0, B)])
async def test_each_worker_is_priced_at_what_its_own_steps_cost(slower: float, chosen: str) -> None:
    """A holds half the prompt; computing the other half on a device 20 times slower
    takes longer than the whole prompt on B."""
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 10, B: []}, prompt)
    slow = StepCosts(0.01 * slower, 1e-3 * slower, 0.0, 2e-3 * slower, step_tokens=256)
    publish(decode, A, slow, scorer._clock())
    publish(decode, B, COSTS, scorer._clock())
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen


async def test_before_any_worker_publishes_the_default_costs_price_the_choice() -> None:
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    # At the defaults (0.5 ms a token, 10 ms a step, 1 ms a decode): A, 16 tokens and
    # 3 decodes, 21 ms; B, 320 tokens, 170 ms.
    load(decode, A, 3, 0)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == A
    load(decode, A, 3, 2 * 304)  # 608 tokens queued before it: 338 ms
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == B
    assert DEFAULT_COSTS.ttft_s(0, 320, 0, 0) > DEFAULT_COSTS.ttft_s(0, 16, 304, 3)


async def test_a_worker_that_has_not_published_is_priced_as_its_peers() -> None:
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    # B publishes costs 10 times the defaults; A, silent, is taken to cost as much:
    # 16 tokens and 2 decodes, 200 ms, against B's 320 tokens, 1.7 s.
    expensive = StepCosts(0.1, 5e-3, 0.0, 1e-2, step_tokens=512)
    publish(decode, B, expensive, scorer._clock())
    load(decode, A, 2, 0)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == A
    # 400 tokens queued on A at B's price: 2.2 s (at the defaults it would be 0.22 s).
    load(decode, A, 2, 400)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == B


@pytest.mark.parametrize(("b_learned", "chosen"), [(500, B), (200_000, A)])
async def test_a_dear_prefill_learned_from_few_prompts_is_drawn_toward_the_peers(
    b_learned: int, chosen: str
) -> None:
    """B learned a prompt token three times dearer than A: from 500 tokens, that is
    mostly noise and B is priced near A's 1 ms (its 320 tokens, 0.3-0.4 s, against A's
    400 queued tokens and 3 decodes, 0.8 s): B gets the prompt, and learns better from
    it; from 200k tokens, B is taken at its word (about 1.2 s) and A keeps it."""
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [], B: []}, prompt)
    publish(decode, A, replace(COSTS, prefill_tokens=50_000), scorer._clock())
    dear = replace(COSTS, prefill_token_s=3e-3, prefill_tokens=b_learned)
    publish(decode, B, dear, scorer._clock())
    load(decode, A, 3, 400)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen


def test_prefill_costs_are_drawn_toward_the_pool_by_the_tokens_learned_from() -> None:
    a = replace(COSTS, prefill_token_s=1e-3, prefill_key_s=1e-8, prefill_tokens=3 * 8192)
    b = replace(COSTS, prefill_token_s=3e-3, prefill_key_s=3e-8, prefill_tokens=8192)
    drawn = drawn_to_peers({A: a, B: b})
    # The pool's: (3 x 1 + 1 x 3) / 4 = 1.5 ms; A keeps 3/4 of its own, B 1/2.
    assert drawn[A].prefill_token_s == pytest.approx(0.75 * 1e-3 + 0.25 * 1.5e-3)
    assert drawn[B].prefill_token_s == pytest.approx(0.5 * 3e-3 + 0.5 * 1.5e-3)
    assert drawn[B].prefill_key_s == pytest.approx(0.5 * 3e-8 + 0.5 * 1.5e-8)
    assert drawn[B].base_s == b.base_s and drawn[B].decode_token_s == b.decode_token_s
    # Workers that say nothing of what they learned from keep their own figures.
    assert drawn_to_peers({A: COSTS, B: replace(COSTS, prefill_token_s=3e-3)})[B] == replace(
        COSTS, prefill_token_s=3e-3
    )


async def test_predictions_within_a_millisecond_go_to_the_less_loaded() -> None:
    prompt = prompt_of(10 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 4, B: [0] * 4}, prompt)
    free_decodes = StepCosts(0.01, 1e-3, 0.0, 0.0, step_tokens=256)
    for url in (A, B):
        publish(decode, url, free_decodes, scorer._clock())
    load(decode, B, 1, 0)
    for _ in range(10):
        choice = scorer.choose(decode, prompt)
        assert choice is not None and choice.worker.url == A


async def test_equal_work_goes_to_the_less_loaded() -> None:
    prompt = prompt_of(10 * BLOCK, weight=0)  # load weighs nothing: equal work
    scorer, decode = await scorer_with({A: [0] * 4, B: [0] * 4}, prompt)
    worker_b = decode.get(B)
    assert worker_b is not None
    worker_b.in_flight = 1
    for _ in range(10):
        choice = scorer.choose(decode, prompt)
        assert choice is not None and choice.worker.url == A


async def test_a_nearly_full_cache_is_passed_over() -> None:
    prompt = prompt_of(10 * BLOCK)
    scorer, decode = await scorer_with({A: [0] * 9, B: []}, prompt)
    worker_a = decode.get(A)
    assert worker_a is not None
    worker_a.published = PublishedLoad(at=scorer._clock(), kv_cache_usage=0.99)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == B


async def test_the_last_token_is_never_predicted_cached() -> None:
    prompt = prompt_of(4 * BLOCK)  # four full blocks: the engine finds three
    scorer, decode = await scorer_with({A: [0] * 4}, prompt)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.cached_tokens == 3 * BLOCK


@pytest.mark.parametrize(("cached", "mode"), [(0, "disaggregated"), (10 * BLOCK, "colocated")])
async def test_the_mode_follows_the_tokens_the_decode_worker_lacks(cached: int, mode: str) -> None:
    prompt = prompt_of(13 * BLOCK)  # 208 tokens: disaggregated by length
    scorer, _ = await scorer_with({}, prompt)
    assert scorer.mode(prompt, "disaggregated", cached) == mode


def test_a_load_only_table_asks_for_no_blocks() -> None:
    assert KVPrompt.of([1, 2, 3], table(policy="load")) is None
    hashes = prefix_hashes(list(range(3, 3 + 2 * BLOCK)), BLOCK)
    assert prompt_of(2 * BLOCK).keys == tuple(block_key(h) for h in hashes)


async def test_what_the_engine_found_is_counted_against_the_prediction() -> None:
    prompt = prompt_of(10 * BLOCK)
    scorer, _ = await scorer_with({}, prompt)
    actual = scorer.metrics.actual_hits.labels(pool="p", role="router", target="decode")

    def outcomes() -> dict[str, float]:
        counter = scorer.metrics.predictions
        return {
            result: counter.labels(pool="p", role="router", target="decode", result=result).value
            for result in ("exact", "over", "under", "unknown")
        }

    for predicted, header in [(48, "48"), (48, "32"), (0, "16")]:
        scorer.observed("r", prompt, predicted, header)
    # A worker's word that is no count of this prompt's tokens is counted as unknown.
    for word in (None, "-1", "1e3", "٣", str(10 * BLOCK + 1)):
        scorer.observed("r", prompt, 48, word)
    assert actual.value == 48 + 32 + 16
    assert outcomes() == {"exact": 1, "over": 1, "under": 1, "unknown": 5}


@pytest.mark.parametrize("disaggregated", [False, True])
async def test_a_worker_is_loaded_with_the_prompt_tokens_it_lacks(disaggregated: bool) -> None:
    """A request whose prompt the prefilling worker mostly holds adds only the rest
    to its waiting prefill tokens (the whole prompt would drive the next request of
    the same conversation away from its cache)."""
    registry = CollectorRegistry()
    decode, prefill = WorkerSet("decode"), WorkerSet("prefill")
    decode.update([A])
    prefill.update(["http://p:1"])
    forwarder = Forwarder(Upstreams(1.0), prefill, decode, None, RouterMetrics("p", registry))
    routed = Routed(
        "/v1/completions", b"{}", False, 20 * BLOCK, "gt64", "colocated", "r", "r", 0.0, Slo()
    )
    worker_a, worker_p = decode.get(A), prefill.get("http://p:1")
    assert worker_a is not None and worker_p is not None
    prefills = worker_p if disaggregated else worker_a
    used = worker_p if disaggregated else None
    load = Outstanding(forwarder, routed, worker_a, used, (12 * BLOCK, 4 * BLOCK))
    assert prefills.prefill_tokens == 20 * BLOCK - (4 if disaggregated else 12) * BLOCK
    load.answered()
    assert prefills.prefill_tokens == 0 and worker_a.in_flight == 1
    load.ended()
    assert prefills.prefill_tokens == 0 and worker_a.in_flight == 0


GOOD_COSTS = {
    "base_s": 0.01, "prefill_token_s": 5e-4, "prefill_key_s": 1e-9, "decode_token_s": 1e-3,
    "decode_s": 0.006, "decodes": 3, "step_tokens": 512, "steps": 40,
}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"prefill_token_s": -1e-4}, {"base_s": float("nan")}, {"decode_s": float("inf")},
        {"prefill_token_s": "0.001"}, {"decodes": True}, {"step_tokens": 0},
        {"decode_token_s": 1e9}, {"decodes": 2.5}, {"prefill_tokens": -1},
        {"prefill_tokens": 1.5}, {"prefill_tokens": 2**60}, {"prefill_tokens": False},
    ],
)  # fmt: skip
def test_costs_a_worker_publishes_out_of_bounds_are_not_believed(change: dict[str, object]) -> None:
    assert StepCosts.of(GOOD_COSTS) == StepCosts(0.01, 5e-4, 1e-9, 1e-3, 0.006, 3, 512)
    assert StepCosts.of(GOOD_COSTS | change) is None
    missing = dict(GOOD_COSTS)
    del missing["step_tokens"]
    assert StepCosts.of(missing) is None and StepCosts.of([1, 2]) is None
    # A worker's /load without them (an older worker) publishes no costs.
    assert PublishedLoad.of({"in_flight": 1}, 0.0, 0, 0).costs is None
    assert PublishedLoad.of({"step_costs": GOOD_COSTS}, 0.0, 0, 0).costs is not None


# Seats, blocks and running requests: what waiting for a seat or for KV blocks costs.
ROOM = {"max_num_seqs": 4, "num_kv_blocks": 100, "kv_blocks_free": 60, "finishing": []}


def room_of(**change: object) -> BatchRoom:
    room = BatchRoom.of(ROOM | change)
    assert room is not None
    return room


def test_a_request_waits_for_the_running_request_whose_end_frees_its_seat() -> None:
    room = room_of(finishing=[[30, 5], [5, 8], [12, 2], [40, 1]])
    assert room.finishing[0] == (5, 8)  # soonest first, whatever order was published
    assert room.wait_steps(requests=3, blocks_needed=10) == 0  # a seat is free
    assert room.wait_steps(requests=4, blocks_needed=10) == 5  # the first to end
    assert room.wait_steps(requests=6, blocks_needed=10) == 30  # the third
    # Beyond every running request: a round of ends more (the last's steps again).
    assert room.wait_steps(requests=8, blocks_needed=10) == 40 + 5


def test_a_request_waits_for_the_running_requests_whose_ends_free_its_blocks() -> None:
    room = room_of(kv_blocks_free=10, finishing=[[3, 4], [7, 9], [20, 40]])
    assert room.wait_steps(requests=0, blocks_needed=10) == 0
    assert room.wait_steps(requests=0, blocks_needed=20) == 7  # 4 + 9 blocks: 13 >= 10
    assert room.wait_steps(requests=0, blocks_needed=30) == 20
    assert room.wait_steps(requests=0, blocks_needed=500) == 20  # every one ends first
    # A seat and blocks: the longer wait.
    assert room.wait_steps(requests=4, blocks_needed=14) == 3
    assert room_of(kv_blocks_free=0).wait_steps(requests=0, blocks_needed=5) == 0  # nobody runs


@pytest.mark.parametrize(
    "change",
    [
        {"max_num_seqs": 0}, {"max_num_seqs": True}, {"num_kv_blocks": -1},
        {"kv_blocks_free": 101}, {"kv_blocks_free": 2.5}, {"finishing": {"a": 1}},
        {"finishing": [[1, 1]] * 5}, {"finishing": [[1, 101]]}, {"finishing": [[-1, 1]]},
        {"finishing": [[1, 2, 3]]}, {"finishing": [["1", 2]]},
    ],
)  # fmt: skip
def test_a_room_a_worker_publishes_out_of_bounds_is_not_believed(change: dict[str, object]) -> None:
    assert BatchRoom.of(ROOM | change) is None
    for name in ROOM:
        assert BatchRoom.of({k: v for k, v in ROOM.items() if k != name}) is None
    assert PublishedLoad.of(ROOM | change, 0.0, 0, 0).room is None
    assert PublishedLoad.of(ROOM, 0.0, 0, 0).room == room_of()


def publish_room(decode: WorkerSet, url: str, room: dict[str, object], at: float) -> None:
    worker = decode.get(url)
    assert worker is not None
    costs = {"base_s": 0.01, "prefill_token_s": 1e-3, "prefill_key_s": 0.0,
             "decode_token_s": 2e-3, "decode_s": 0.0, "decodes": 0, "step_tokens": 256}  # fmt: skip
    body = {"step_costs": costs} | room
    worker.published = PublishedLoad.of(body, at, worker.in_flight, worker.prefill_tokens)
    assert worker.published.costs == COSTS and worker.published.room is not None


# A holds the whole prompt but its last token, B nothing, both idle but for A's 4
# requests: at COSTS, A computes 1 token in one step with 4 decodes (1 + 10 + 8 =
# 19 ms), B the whole 321 in two steps (321 + 20 = 341 ms).
@pytest.mark.parametrize(
    ("room", "chosen"),
    [
        # Its batch has a seat and its cache the blocks: the cache wins.
        ({"max_num_seqs": 8, "kv_blocks_free": 60, "finishing": [[30, 4]] * 4}, A),
        # No seat until one of its 4 requests ends, in 30 steps of 18 ms: 559 ms.
        ({"max_num_seqs": 4, "kv_blocks_free": 60, "finishing": [[30, 4]] * 4}, B),
        # A seat soon (2 steps: 36 ms more): still the cache.
        ({"max_num_seqs": 4, "kv_blocks_free": 60, "finishing": [[2, 4], *[[30, 4]] * 3]}, A),
        # A seat, but no free block until one of them ends (30 steps): B.
        ({"max_num_seqs": 8, "kv_blocks_free": 0, "finishing": [[30, 1]] * 4}, B),
    ],
)
async def test_a_cached_worker_that_would_make_the_request_wait_loses_to_an_idle_one(
    room: dict[str, object], chosen: str
) -> None:
    prompt = prompt_of(20 * BLOCK + 1, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    load(decode, A, 4, 0)
    now = scorer._clock()
    publish_room(decode, A, {"num_kv_blocks": 100} | room, now)
    publish_room(decode, B, {"num_kv_blocks": 100, "max_num_seqs": 8, "kv_blocks_free": 100,
                             "finishing": []}, now)  # fmt: skip
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen


async def test_steps_run_since_a_worker_published_shorten_its_wait() -> None:
    prompt = prompt_of(20 * BLOCK + 1, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    load(decode, A, 4, 0)
    full = {"num_kv_blocks": 100, "max_num_seqs": 4, "kv_blocks_free": 60,
            "finishing": [[30, 4]] * 4}  # fmt: skip
    idle = {"num_kv_blocks": 100, "max_num_seqs": 8, "kv_blocks_free": 100, "finishing": []}
    now = scorer._clock()
    publish_room(decode, B, idle, now)
    # Published 0.45 s ago (25 steps of 18 ms): 5 steps left to wait, 109 ms in all
    # (559 ms had no step run since).
    publish_room(decode, A, full, now - 0.45)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == A


async def test_a_nearly_full_cache_with_the_blocks_the_request_needs_keeps_it() -> None:
    """A worker that publishes its room is judged on the wait it predicts, not on its
    usage: 96% used, it still has the one block the prompt's last token needs."""
    prompt = prompt_of(20 * BLOCK + 1, weight=None)
    scorer, decode = await scorer_with({A: [0] * 20, B: []}, prompt)
    now = scorer._clock()
    nearly_full = {"num_kv_blocks": 100, "max_num_seqs": 8, "kv_blocks_free": 4,
                   "finishing": [[30, 24]] * 4, "kv_cache_usage": 0.96}  # fmt: skip
    publish_room(decode, A, nearly_full, now)
    publish_room(decode, B, {"num_kv_blocks": 100, "max_num_seqs": 8, "kv_blocks_free": 100,
                             "finishing": []}, now)  # fmt: skip
    load(decode, A, 4, 0)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == A


def sent(decode: WorkerSet, url: str, *prompts: int) -> None:
    worker = decode.get(url)
    assert worker is not None
    worker.in_flight += len(prompts)
    for tokens in prompts:
        worker.prefill_sent(tokens)


def publish_order(decode: WorkerSet, url: str, order: object, at: float) -> None:
    worker = decode.get(url)
    assert worker is not None
    body: dict[str, object] = {}
    body["step_costs"] = {"base_s": 0.01, "prefill_token_s": 1e-3, "prefill_key_s": 0.0,
                          "decode_token_s": 2e-3, "decode_s": 0.0, "decodes": 0,
                          "step_tokens": 256}  # fmt: skip
    if order is not None:
        body["prefill_order"] = order
    worker.published = PublishedLoad.of(body, at, worker.in_flight, worker.prefill_tokens)


# A holds 19 of the prompt's 20 blocks and has a 2,000-token prompt in flight; B holds
# nothing and is idle (340 ms at COSTS). First come, first served, A computes 2,016
# tokens in 8 steps with a decode each (2016 + 8 x 12 = 2,112 ms): B. Shortest first,
# A computes its 16 tokens after at most the step under way, counted once more for the
# long prompt they delay (288 tokens in 2 steps, 312 ms): A.
@pytest.mark.parametrize(
    ("order", "chosen"), [("shortest", A), ("arrival", B), (None, B), ("random", B)]
)
async def test_a_hit_goes_to_the_worker_holding_it_past_a_long_prompt_when_it_serves_shortest_first(
    order: str | None, chosen: str
) -> None:
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 19, B: []}, prompt)
    sent(decode, A, 2000)
    now = scorer._clock()
    publish_order(decode, A, order, now)
    publish_order(decode, B, order, now)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen
    assert choice.cached_tokens == (19 * BLOCK if chosen == A else 0)


async def test_shortest_first_the_shorter_prompts_in_flight_still_delay_a_hit() -> None:
    """A's 16 uncached tokens wait behind the 1,000 tokens of prompts no longer than
    them (1,016 + 256 + 16 tokens in 6 steps, 1,360 ms): B's 340 ms wins."""
    prompt = prompt_of(20 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [0] * 19, B: []}, prompt)
    decode_a = decode.get(A)
    assert decode_a is not None
    for _ in range(100):
        decode_a.prefill_sent(10)
    sent(decode, A, 2000)
    now = scorer._clock()
    publish_order(decode, A, "shortest", now)
    publish_order(decode, B, "shortest", now)
    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == B


async def test_the_prompts_ahead_of_a_new_one_follow_the_workers_prefill_order() -> None:
    decode = WorkerSet("decode")
    decode.update([A])
    worker = decode.get(A)
    assert worker is not None
    for tokens in (10, 500, 16, 2000):
        worker.prefill_sent(tokens)
    now = 100.0
    worker.published = PublishedLoad.of({}, now, worker.in_flight, worker.prefill_tokens)
    assert worker.published.prefill_order == "arrival"  # not published: as before
    assert worker.prefill_ahead(16, now, step_tokens=256) == 2526
    worker.published = PublishedLoad.of(
        {"prefill_order": "shortest"}, now, worker.in_flight, worker.prefill_tokens
    )
    # The two no longer than 16 (a tie goes to the earlier), then the step under way,
    # and its own tokens once for each of the two longer prompts it delays.
    assert worker.prefill_ahead(16, now, step_tokens=256) == 10 + 16 + 256 + 2 * 16
    assert worker.prefill_ahead(600, now, step_tokens=256) == 526 + 256 + 600
    assert worker.prefill_ahead(5000, now, step_tokens=256) == 2526
    worker.prefill_done(2000)
    worker.prefill_done(10)
    assert worker.prefill_tokens == 516 and sorted(worker.prefill_prompts) == [16, 500]
    assert worker.prefill_ahead(16, now, step_tokens=256) == 16 + 256 + 16
    # What the worker published beyond the router's own count is one prompt more.
    worker.published = PublishedLoad.of(
        {"prefill_order": "shortest", "prefill_tokens": 516 + 8}, now, 0, 516
    )
    assert worker.prefill_ahead(16, now, step_tokens=256) == 16 + 8 + 256 + 16


def test_a_worker_tells_the_blocks_a_prompt_sent_it_will_hold_once_computed() -> None:
    worker = Worker(A, "decode")
    first = tuple(range(100, 130))  # a prompt of 30 blocks
    other = (*first[:12], *range(900, 910))  # shares its first 12
    worker.prefill_sent(480, first)
    worker.prefill_sent(40, other)
    assert worker.pending_blocks((*first[:20], 5, 6)) == (20, 480)
    assert worker.pending_blocks((*first[:12], 900, 901, 7)) == (14, 40)
    assert worker.pending_blocks((7, *first[1:])) == (0, 0)
    assert worker.pending_blocks(first) == (30, 480)
    worker.prefill_done(480, first)  # its first token: the index has its blocks now
    assert worker.pending_blocks(first) == (12, 40)
    assert worker.prefill_prompts == [40] and worker.prefill_keys == [other]


@pytest.mark.parametrize(("b_waiting", "chosen", "cached"), [(300, A, 38), (0, B, 0)])
async def test_a_prompt_waits_for_the_prefix_a_worker_is_computing_when_that_is_sooner(
    b_waiting: int, chosen: str, cached: int
) -> None:
    """A prompt of 40 blocks whose first 38 a prompt just sent to A holds (A has not
    computed them: the index knows nothing of them). A serves prompts shortest first,
    so the new prompt waits for that one (610 tokens) and then finds 608 cached: 642
    tokens in 3 steps with 3 decodes, 642 + 3 x 16 = 690 ms (counted as uncached, the
    whole prompt after that one: 1,250 tokens in 5 steps, 1,330 ms). B, with 300
    tokens queued, computes them and the whole prompt: 940 tokens in 4 steps with a
    decode, 988 ms; idle, 640 tokens in 3 steps, 670 ms."""
    prompt = prompt_of(40 * BLOCK, weight=None)
    scorer, decode = await scorer_with({A: [], B: []}, prompt)
    for url in (A, B):
        worker = decode.get(url)
        assert worker is not None
        worker.published = PublishedLoad(at=scorer._clock(), costs=COSTS, prefill_order="shortest")
    earlier = prompt_of(38 * BLOCK + 2, weight=None)
    worker_a = decode.get(A)
    assert worker_a is not None
    worker_a.in_flight = 3
    worker_a.prefill_sent(610, earlier.keys)
    load(decode, B, 1 if b_waiting else 0, b_waiting)

    choice = scorer.choose(decode, prompt)
    assert choice is not None and choice.worker.url == chosen
    assert choice.cached_tokens == cached * BLOCK
