"""How the router picks workers: circuit breakers, loads, fresh and stale figures."""

from __future__ import annotations

from pdserve.workers.router.breaker import CircuitBreaker
from pdserve.workers.router.workers import FRESH_S, PublishedLoad, WorkerSet


class Clock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(breaker: CircuitBreaker) -> str:
    """The breaker's state, read afresh at each call (a type checker would otherwise
    carry one comparison's answer over to the next)."""
    return breaker.state


def test_breaker_opens_after_failures_in_a_row_and_lets_one_trial_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    breaker.failed()
    breaker.failed()
    breaker.succeeded()  # a success breaks the run
    breaker.failed()
    breaker.failed()
    assert state(breaker) == "closed" and breaker.available()
    breaker.failed()
    assert state(breaker) == "open" and not breaker.available()
    breaker.succeeded()  # a probe during the cooldown proves too little
    assert state(breaker) == "open"
    clock.now += 2.0
    assert state(breaker) == "half_open" and breaker.available()
    breaker.dispatched()
    assert not breaker.available()  # one trial at a time
    breaker.failed()  # the trial failed: open again, for longer
    clock.now += 2.0
    assert state(breaker) == "open"
    clock.now += 2.0
    breaker.dispatched()
    breaker.failed()
    clock.now += 4.9  # the cooldown is capped at 5 s
    assert state(breaker) == "open"
    clock.now += 0.2
    breaker.succeeded()
    assert state(breaker) == "closed" and breaker.available()


def workers(role: str, clock: Clock, *urls: str) -> WorkerSet:
    found = WorkerSet(role, clock=clock)  # type: ignore[arg-type]
    found.update(urls)
    return found


def test_prefill_goes_to_the_fewest_prompt_tokens_waiting() -> None:
    clock = Clock()
    prefill = workers("prefill", clock, "http://a:1", "http://b:1")
    a, b = prefill.get("http://a:1"), prefill.get("http://b:1")
    assert a is not None and b is not None
    a.published = PublishedLoad(clock.now, prefill_tokens=4000)
    b.published = PublishedLoad(clock.now, prefill_tokens=100)
    assert prefill.choose() is b
    b.prefill_tokens = 5000  # what this router sent, not yet reported by the worker
    assert prefill.choose() is a
    assert prefill.choose(exclude={"http://a:1"}) is b


def test_decode_goes_to_the_fewest_requests_then_the_emptier_cache() -> None:
    clock = Clock()
    decode = workers("decode", clock, "http://a:1", "http://b:1", "http://c:1")
    a, b, c = (decode.get(f"http://{name}:1") for name in "abc")
    assert a is not None and b is not None and c is not None
    a.published = PublishedLoad(clock.now, in_flight=3, kv_cache_usage=0.1)
    b.published = PublishedLoad(clock.now, in_flight=1, kv_cache_usage=0.5)
    c.published = PublishedLoad(clock.now, in_flight=1, kv_cache_usage=0.2)
    assert decode.choose() is c
    c.published = PublishedLoad(clock.now, in_flight=0, kv_cache_usage=0.97)
    assert decode.choose() is b  # a nearly full cache is passed over while others are not
    # Figures older than FRESH_S are not used: the router's own count decides.
    clock.now += FRESH_S + 0.1
    a.in_flight, b.in_flight, c.in_flight = 0, 2, 1
    assert decode.choose() is a


def test_requests_that_ended_since_the_last_poll_do_not_count() -> None:
    # Seven streams the router sent to `a` end together; `a`'s published load, read
    # while they ran, still says 7 until the next poll. The seven clients' next requests
    # must not all herd onto `b`.
    clock = Clock()
    decode = workers("decode", clock, "http://a:1", "http://b:1")
    a, b = decode.get("http://a:1"), decode.get("http://b:1")
    assert a is not None and b is not None
    a.in_flight, b.in_flight = 7, 1
    a.read({"in_flight": 7}, clock.now)
    b.read({"in_flight": 1}, clock.now)
    a.in_flight = 0  # the burst ended
    chosen = []
    for _ in range(7):
        worker = decode.choose()
        assert worker is not None
        worker.in_flight += 1
        chosen.append(worker.url)
    assert sorted(chosen).count("http://a:1") == 4  # 4 + 0 beside 3 + 1
    # What the worker holds beyond the router's count (another router's requests)
    # still counts while fresh.
    b.read({"in_flight": b.in_flight + 5}, clock.now)
    assert decode.choose() is a


def test_workers_with_an_open_breaker_get_nothing_and_discovery_keeps_state() -> None:
    clock = Clock()
    decode = workers("decode", clock, "http://a:1", "http://b:1")
    a = decode.get("http://a:1")
    assert a is not None
    for _ in range(3):
        a.breaker.failed()
    assert {decode.choose() for _ in range(20)} == {decode.get("http://b:1")}
    decode.update(["http://a:1", "http://c:1"])  # b left, c joined, a keeps its breaker
    assert decode.urls == ["http://a:1", "http://c:1"]
    assert decode.get("http://a:1") is a and not a.breaker.available()
    decode.update([])
    assert decode.choose() is None


def test_workers_are_scored_in_discoverys_order_whatever_the_process() -> None:
    # The order candidates are scored in decides which of them each draw of chance
    # goes to: kept as discovery lists them (a set's order changes with the process's
    # string hashing, and a simulation's draws with it), new ones after those known.
    clock = Clock()
    listed = [f"http://decode-{i}:8000" for i in (7, 3, 11, 0, 19, 5, 14, 2, 9, 16)]
    found = workers("decode", clock, *listed)
    assert [w.url for w in found.available()] == listed
    found.update([*listed[5:], "http://decode-4:8000", *listed[:3]])
    assert [w.url for w in found.available()] == [*listed[:3], *listed[5:], "http://decode-4:8000"]
