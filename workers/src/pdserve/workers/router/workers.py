"""The workers the router knows, per role: where they are (from discovery), whether
they may be used (a circuit breaker each), and how loaded they are (what each
publishes at /load, polled, combined with the router's own count of what it sent).

Choice by load: a prefill worker by the fewest prompt tokens waiting to be prefilled,
a decode worker by the fewest requests in flight, then the lowest KV cache usage. The
router's own count of what it sent is always used, and is current; a published load
adds only what it held beyond that count when it was read (work other routers sent,
or work the worker has not let go of), and only while fresh (`FRESH_S`). Taking a
published figure as it stands would make requests herd: a burst that ended a moment
ago still looks busy until the next poll, and every new request goes elsewhere.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pdserve.protocol.routing import Role
from pdserve.workers.router.breaker import CircuitBreaker
from pdserve.workers.router.kv_costs import StepCosts
from pdserve.workers.router.kv_room import BatchRoom
from pdserve.workers.router.kv_subscriber import KVFeedStatus

FRESH_S = 1.0
# A decode worker whose KV cache is this full is passed over while others are not.
KV_NEARLY_FULL = 0.95


@dataclass(frozen=True)
class PublishedLoad:
    """A worker's /load, as read at `at` (time.monotonic)."""

    at: float
    in_flight: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefill_tokens: int = 0
    # The router's own counts when the load was read: what it had sent and not seen end.
    own_in_flight: int = 0
    own_prefill_tokens: int = 0
    costs: StepCosts | None = None  # what its steps cost (None: not published)
    room: BatchRoom | None = None  # its seats, blocks and running requests (None: not published)
    prefill_order: str = "arrival"  # the order its prompts take a step's budget

    @property
    def other_in_flight(self) -> int:
        """Requests the worker held beyond those the router had sent."""
        return max(0, self.in_flight - self.own_in_flight)

    @property
    def other_prefill_tokens(self) -> int:
        """Prompt tokens waiting beyond those the router had sent."""
        return max(0, self.prefill_tokens - self.own_prefill_tokens)

    @classmethod
    def of(cls, body: Any, at: float, own_in_flight: int, own_prefill_tokens: int) -> PublishedLoad:
        """From the JSON body of /load (missing or odd fields count as zero), read
        when the router's own counts were `own_in_flight` and `own_prefill_tokens`."""
        fields = body if isinstance(body, dict) else {}

        def number(key: str) -> float:
            value = fields.get(key, 0)
            return float(value) if isinstance(value, int | float) else 0.0

        return cls(
            at,
            in_flight=int(number("in_flight")),
            waiting=int(number("waiting")),
            kv_cache_usage=number("kv_cache_usage"),
            prefill_tokens=int(number("prefill_tokens")),
            own_in_flight=own_in_flight,
            own_prefill_tokens=own_prefill_tokens,
            costs=StepCosts.of(fields.get("step_costs")),
            room=BatchRoom.of(fields),
            # Anything but a known order (an older worker publishes none) is taken
            # as first come, first served: the prediction that assumes the most wait.
            prefill_order="shortest" if fields.get("prefill_order") == "shortest" else "arrival",
        )


class WorkerState(BaseModel):
    """A worker in GET /workers."""

    url: str
    state: str  # its circuit breaker's: closed, open or half_open
    in_flight: int  # requests the router sent it that have not ended
    published: PublishedLoad | None  # its /load, as last read
    kv: KVFeedStatus | None = None  # its KV event feed (KV-aware routing only)
    revision: str | None = None  # its revision, as it published it


# The body of GET /workers: the workers of each role.
WorkersAnswer = dict[str, list[WorkerState]]


@dataclass(eq=False)
class Worker:
    """One worker as the router sees it (equal only to itself)."""

    url: str
    role: Role
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    published: PublishedLoad | None = None
    in_flight: int = 0  # requests the router has sent and not seen end
    prefill_tokens: int = 0  # prompt tokens the router sent it to prefill, not yet done
    # The uncached tokens of each prompt in `prefill_tokens`, in the order sent, and
    # its blocks' keys (KV-aware routing; else empty): blocks the worker will hold
    # once that prompt is computed, which the index learns only then.
    prefill_prompts: list[int] = field(default_factory=list)
    prefill_keys: list[Sequence[int]] = field(default_factory=list)
    revision: str | None = None  # its --revision as it last published it (None: not yet)

    def fresh(self, now: float) -> PublishedLoad | None:
        """The published load, if recent enough to go by."""
        published = self.published
        return published if published is not None and now - published.at <= FRESH_S else None

    def read(self, body: Any, at: float) -> None:
        """Record a /load answer read at `at`, beside the router's own counts then."""
        self.published = PublishedLoad.of(body, at, self.in_flight, self.prefill_tokens)
        revision = body.get("revision", "") if isinstance(body, dict) else ""
        self.revision = revision if isinstance(revision, str) else ""

    def requests(self, now: float) -> int:
        """Requests it holds: the router's own, and others it published lately."""
        return self.in_flight + (self.fresh(now) or PublishedLoad(now)).other_in_flight

    def waiting_prefill_tokens(self, now: float) -> int:
        """Prompt tokens waiting to be prefilled in it."""
        return self.prefill_tokens + (self.fresh(now) or PublishedLoad(now)).other_prefill_tokens

    def prefill_sent(self, tokens: int, keys: Sequence[int] = ()) -> None:
        """A prompt with `tokens` uncached tokens (and blocks `keys`) was sent it to
        prefill."""
        self.prefill_tokens += tokens
        self.prefill_prompts.append(tokens)
        self.prefill_keys.append(keys)

    def prefill_done(self, tokens: int, keys: Sequence[int] = ()) -> None:
        """A prompt counted by `prefill_sent(tokens, keys)` has its first token (or
        ended)."""
        self.prefill_tokens -= tokens
        # That prompt, else the oldest of its size (only the sizes count for load).
        sizes, sent = self.prefill_prompts, self.prefill_keys
        # A loop, not next() over a generator: one left unfinished is closed by raising
        # GeneratorExit in it (for every request).
        index = None
        for at, sent_keys in enumerate(sent):
            if sent_keys is keys and sizes[at] == tokens:
                index = at
                break
        if index is None:
            with contextlib.suppress(ValueError):
                index = sizes.index(tokens)
        if index is not None:
            del sizes[index], sent[index]

    def pending_blocks(self, keys: Sequence[int]) -> tuple[int, int]:
        """Of a prompt's first blocks (`keys`), the most that one prompt sent it and
        not yet computed shares, and that prompt's uncached tokens ((0, 0) if none):
        blocks the worker will hold once that prompt is computed. Keys are chained (a
        block's key covers every block before it), so the shared blocks are found by
        bisection."""
        best = (0, 0)
        for tokens, sent in zip(self.prefill_prompts, self.prefill_keys, strict=True):
            low, high = 0, min(len(keys), len(sent))  # keys[:low] == sent[:low]
            if high <= best[0] or not high or keys[0] != sent[0]:
                continue
            while low < high:
                middle = (low + high + 1) // 2
                if keys[middle - 1] == sent[middle - 1]:
                    low = middle
                else:
                    high = middle - 1
            if low > best[0]:
                best = (low, tokens)
        return best

    def prefill_ahead(self, uncached: int, now: float, step_tokens: int) -> int:
        """Prompt tokens waiting in it that its engine computes before a new prompt of
        `uncached` tokens. First come, first served (`arrival`, or an order not
        published): all of them. Shortest first: those of prompts no longer than it
        (ties go to the earlier arrival), and of the longer ones at most the step
        under way (`step_tokens`, the next step serves the new prompt first), plus
        the new prompt's tokens once for each longer prompt it delays. What it
        published beyond the router's own count is one prompt of unknown parts.
        O(prompts in flight), no allocation."""
        waiting = self.waiting_prefill_tokens(now)
        order = self.published.prefill_order if self.published is not None else "arrival"
        if order != "shortest":
            return waiting
        shorter = longer = overtaken = 0
        for tokens in self.prefill_prompts:
            if tokens <= uncached:
                shorter += tokens
            else:
                longer += tokens
                overtaken += 1
        # Tokens counted in the sum but not sized (set directly), and others'.
        unsized = waiting - shorter - longer
        if 0 < unsized <= uncached:
            shorter += unsized
        elif unsized > 0:
            longer += unsized
            overtaken += 1
        # Each longer prompt it overtakes waits for its tokens: counted too, so that
        # the choice weighs what it costs the others (as first come, first served
        # does), and overtaking does not pile new prompts onto one worker.
        return shorter + min(longer, max(0, step_tokens)) + overtaken * uncached

    def step_costs(self) -> StepCosts | None:
        """What its steps cost, as last published (they change slowly: not only while
        fresh)."""
        return None if self.published is None else self.published.costs

    def room(self, now: float) -> tuple[BatchRoom, float] | None:
        """Its seats, blocks and running requests as lately published, and when they
        were read (None when not fresh or not published)."""
        published = self.fresh(now)
        if published is None or published.room is None:
            return None
        return published.room, published.at

    def kv_cache_usage(self, now: float) -> float:
        """Its KV cache usage as lately published (0 when not fresh)."""
        return (self.fresh(now) or PublishedLoad(now)).kv_cache_usage

    def score(self, now: float) -> tuple[float, ...]:
        """Lower is better."""
        requests = self.requests(now)
        if self.role == "prefill":
            return (self.waiting_prefill_tokens(now), requests)
        usage = self.kv_cache_usage(now)
        return (float(usage >= KV_NEARLY_FULL), requests, usage)


class WorkerSet:
    """The workers of one role, kept as discovery reports them."""

    def __init__(
        self,
        role: Role,
        breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role = role
        self._breaker = breaker
        self._clock = clock
        self._workers: dict[str, Worker] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Any:
        return iter(list(self._workers.values()))

    @property
    def urls(self) -> list[str]:
        """The workers' base URLs."""
        return sorted(self._workers)

    def update(self, urls: Iterable[str]) -> None:
        """Discovery's current list: new workers join, gone ones leave; the rest keep
        their breaker and load."""
        # In discovery's order (a dict, not a set, whose order would change from
        # process to process): the order candidates are scored in, and so which tie
        # each draw of chance breaks, is then the same in every run of a simulation.
        wanted = dict.fromkeys(urls)
        for url in list(self._workers):
            if url not in wanted:
                del self._workers[url]
        for url in wanted:
            if url not in self._workers:
                self._workers[url] = Worker(url, self.role, self._breaker())

    def get(self, url: str) -> Worker | None:
        """The worker at `url`, if known."""
        return self._workers.get(url)

    def available(self) -> list[Worker]:
        """The workers that may be sent a request now."""
        return [w for w in self._workers.values() if w.breaker.available()]

    def choose(self, exclude: Collection[str] = ()) -> Worker | None:
        """The least loaded available worker not in `exclude` (ties broken at random,
        so equal workers share the traffic)."""
        candidates = [w for w in self.available() if w.url not in exclude]
        if not candidates:
            return None
        now = self._clock()
        scores = {w.url: w.score(now) for w in candidates}
        best = min(scores.values())
        return random.choice([w for w in candidates if scores[w.url] == best])
