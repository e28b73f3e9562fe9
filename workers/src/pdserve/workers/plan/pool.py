"""A pool on a simulated clock: the router's bucket and load policy over simulated
workers, the P/D hand-off with its failure policy, and clients that record what
`pdserve bench` records.

What is the real code: the routing table (`bucket_of`), the router's worker choice
(`WorkerSet.choose` by load, or KV-aware `KVScorer` over an index fed by each
engine's prefix-cache events, see `routing`; on loads each worker publishes as
`/load` does, polled as the router polls them), every engine (scheduler, token
budget, KV cache with its prefix cache, leases, `reserve`/`adopt`/`release`), the
workers' flags, and the prompts `pdserve bench` sends (text built from a trace's
prefix blocks is tokenized by the model's tokenizer, as the router tokenizes it).
What is modelled: a step's duration (the profile's step cost, stretched by the
contention of the machine where workers share one: `hosts`), a hand-off's time
beyond the prefill (the profile's fixed plus per-byte cost, for the blocks the
decode worker lacks), each step's spread, and a request's way in and its first
token's way out (the profile's overhead, on an idle or a busy decode worker). The router
counts what it sent as its `Outstanding` does: a request is in flight on its
decode worker until it ends, and the prompt tokens the index says the worker that
computes it lacks (the prefill worker, or colocated the decode worker) wait there
until the first token is back.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from dataclasses import replace as replaced

from pdserve.protocol.routing import ROLES, Role
from pdserve.protocol.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.bench.plan import PlannedRequest, prompt_tokens
from pdserve.workers.bench.prefix_workloads import prompt_text
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.engine.config import ModelConfig
from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.leases import LeaseError, Reservation
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.decode import ROOM_POLL_S, RoomWait, release_margin
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.plan.costs import Profile
from pdserve.workers.plan.events import EventQueue, draw_seed
from pdserve.workers.plan.hosts import shared_host
from pdserve.workers.plan.routing import Route, SimRouter
from pdserve.workers.plan.scenario import Scenario
from pdserve.workers.plan.worker import SimWorker
from pdserve.workers.router.load import POLL_INTERVAL_S
from pdserve.workers.router.workers import WorkerSet
from pdserve.workers.server.worker import torch_threads

NO_WORKER = "HTTP 503: no worker could serve the request"


@dataclass
class SimRequest:
    """One client request through the pool."""

    record: RequestRecord
    request_id: str
    prompt: list[int]
    params: SamplingParams
    route: Route
    reservation: Reservation | None = None
    room: RoomWait | None = None  # its tries to reserve blocks on the decode worker
    room_since: float = 0.0  # when the first one was made
    answered: bool = False
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Traffic:
    """The requests to replay and how their prompts are made (as `pdserve bench`)."""

    plan: list[PlannedRequest]
    seed: int
    vocab_size: int
    drain_timeout_s: float
    horizon_s: float | None
    length_scale: float = 1.0  # of a prefix trace's blocks
    tokenizer: Tokenizer | None = None  # for prompts sent as text (prefix traces)

    def prompt(self, planned: PlannedRequest) -> list[int]:
        """The token ids of a request's prompt, as the router sees them."""
        if planned.prefix is None:
            return prompt_tokens(self.seed, planned.index, planned.input_tokens, self.vocab_size)
        if self.tokenizer is None:
            raise ValueError("a prefix trace's prompts are text: a tokenizer is needed")
        text = prompt_text(self.seed, planned.prefix, self.length_scale)
        return self.tokenizer.encode(text, add_special_tokens=True)


class PoolSimulation:
    """Runs one scenario over one traffic; `run` returns the clients' records."""

    def __init__(
        self, scenario: Scenario, profile: Profile, traffic: Traffic, draw: int = 0
    ) -> None:
        self.scenario = scenario
        # Which of the simulation's draws this run is: its steps' spread and the
        # router's ties are drawn with seeds of their own (`events.draw_seed`).
        self.draw = draw
        self.profile = profile
        self.traffic = traffic
        self.events = EventQueue()
        self.model = ModelConfig.from_dict(profile.model_json)
        self.sets = {role: WorkerSet(role, clock=self._now) for role in ROLES}
        self.router = SimRouter(scenario.table, self.sets, self._now)
        workers = sum(len(scenario.urls(role)) for role in scenario.roles)
        self.host = shared_host(scenario.placement, profile, workers, draw)
        self.workers: dict[str, SimWorker] = {}
        for role, setup in scenario.roles.items():
            urls = scenario.urls(role)
            self.sets[role].update(urls)
            for url in urls:
                worker = self._worker(url, setup.options.role, role)
                worker.feed = self.router.feed(role, url, worker.engine)
                self.workers[url] = worker
        decode_options = scenario.roles["decode"].options
        self.failure_policy = decode_options.transfer_failure_policy
        self.lease_s = decode_options.handoff_timeout
        self.room_wait_s = decode_options.handoff_room_wait
        self.records: list[RequestRecord] = []
        self.routes: dict[int, Route] = {}  # by the request's index in the plan
        self.handoff_failures: dict[str, int] = {}
        self.handoffs_skipped = 0  # prompts the decode worker's cache let it compute
        # What a decode worker may compute itself rather than hand off, as the router
        # tells it (KV-aware routing only).
        self.local_tokens = 0 if self.router.scorer is None else scenario.table.colocated_up_to()
        self._by_id: dict[tuple[str, str], SimRequest] = {}
        self._outstanding = 0
        self._arrivals_left = len(traffic.plan)

    def _now(self) -> float:
        return self.events.now

    def _worker(self, url: str, worker_role: str, role: Role) -> SimWorker:
        setup = self.scenario.roles[role]
        threads = torch_threads(setup.options) or self.profile.threads
        return SimWorker(
            url, worker_role, setup.engine, self.model,
            (self.profile.step_cost, self.profile.serving), self.events,
            setup.options.queue_timeout, self._stepped,
            None if self.host is None else (self.host, threads), self.draw,
        )  # fmt: skip

    # -- the run -------------------------------------------------------------------

    def run(self) -> list[RequestRecord]:
        """Replay the traffic to its end (or the drain deadline, as the bench's)."""
        # The router breaks ties at random.
        seed = self.traffic.seed
        random.seed(seed if self.draw == 0 else draw_seed(str(seed), self.draw))
        for planned in self.traffic.plan:
            self.events.at(planned.offset_s, functools.partial(self._arrive, planned))
        self.events.at(0.0, self._poll)
        last = self.traffic.plan[-1].offset_s if self.traffic.plan else 0.0
        deadline = max(self.traffic.horizon_s or 0.0, last) + self.traffic.drain_timeout_s
        self.events.run(until=deadline)
        for record in self.records:
            if not record.finished and record.error is None:
                record.fail("unfinished at the drain deadline", deadline)
        return self.records

    @property
    def steps(self) -> int:
        """Engine steps run, all workers together."""
        return sum(worker.num_steps for worker in self.workers.values())

    def _poll(self, now: float) -> None:
        """The router's /load poll of every worker, twice a second while work is left."""
        for workers in self.sets.values():
            for worker in workers:
                worker.read(self.workers[worker.url].published_load(), now)
        if self._outstanding or self._arrivals_left:
            self.events.at(now + POLL_INTERVAL_S, self._poll)

    # -- the router ------------------------------------------------------------------

    def _arrive(self, planned: PlannedRequest, now: float) -> None:
        self._arrivals_left -= 1
        record = RequestRecord(
            planned.index, planned.kind, planned.input_tokens, planned.output_tokens, now, now
        )
        self.records.append(record)
        if self.host is not None:
            self.host.request_arrived(now)
        prompt = self.traffic.prompt(planned)
        route = self.router.route(prompt)
        if route is None:
            record.fail(NO_WORKER, now)
            return
        self.routes[planned.index] = route
        params = SamplingParams(max_tokens=planned.output_tokens, temperature=0.0, ignore_eos=True)
        request = SimRequest(record, f"req-{planned.index}", prompt, params, route)
        record.mode = route.mode
        route.decode.in_flight += 1
        # As the router counts it: whoever computes the prompt has what it lacks of it
        # waiting until the first token (colocated, the decode worker).
        route.prefills.prefill_sent(route.uncached(len(prompt)), route.keys)
        self._outstanding += 1
        # Its way in costs more where the decode worker already streams to others.
        reach = now + self.profile.request_overhead(busy=route.decode.in_flight > 1)
        self.events.at(reach, lambda at: self._reach_decode(request, at))

    def _answered(self, request: SimRequest) -> None:
        """The decode worker's answer began: the prompt no longer waits anywhere."""
        if not request.answered:
            request.answered = True
            route = request.route
            route.prefills.prefill_done(route.uncached(len(request.prompt)), route.keys)

    def _ended(self, request: SimRequest, now: float) -> None:
        self._answered(request)
        request.route.decode.in_flight -= 1
        self.workers[request.route.decode.url].load.request_ended()
        self._outstanding -= 1
        del self._by_id[("decode", request.request_id)]
        if request.record.ended_at is None:
            request.record.ended_at = now

    # -- the decode worker -------------------------------------------------------------

    def _reach_decode(self, request: SimRequest, now: float) -> None:
        decode = self.workers[request.route.decode.url]
        decode.load.request_started()
        self._by_id[("decode", request.request_id)] = request
        if request.route.prefill is None:
            decode.post(lambda engine: self._admit(engine, request))
        else:
            decode.post(lambda engine: self._reserve(engine, request))

    def _admit(self, engine: LLMEngine, request: SimRequest) -> list[RequestOutput]:
        try:
            engine.add_request(request.request_id, request.prompt, request.params)
        except InvalidRequestError as error:
            self._refused(request, error)
        return []

    def _refused(self, request: SimRequest, error: InvalidRequestError) -> None:
        """The worker's 400 for a request its engine refuses (too long a prompt)."""
        request.record.fail(f"HTTP 400: {error}", self.events.now)
        self._ended(request, self.events.now)

    def _reserve(self, engine: LLMEngine, request: SimRequest) -> list[RequestOutput]:
        try:
            engine.validate(request.prompt, request.params)
        except InvalidRequestError as error:
            self._refused(request, error)
            return []
        lease_s, margin_s = self.lease_s, release_margin(self.lease_s)
        request.room = RoomWait(
            request.request_id, request.prompt, request.params, lease_s, margin_s,
            self.local_tokens,
        )  # fmt: skip
        request.room_since = self.events.now
        return self._try_reserve(engine, request)

    def _try_reserve(self, engine: LLMEngine, request: SimRequest) -> list[RequestOutput]:
        """As the decode worker's hand-off: reserve, or try again a poll later while
        the wait for free blocks lasts (`DecodeHandoff._reserve`)."""
        assert request.room is not None
        reservation = request.room.try_reserve(engine)
        if request.room.local:  # its cache holds the prompt but a few tokens
            self.handoffs_skipped += 1
            request.record.mode = "colocated"
            return self._admit(engine, request)
        if reservation is None:
            waited = self.events.now - request.room_since
            if request.room.never or waited >= self.room_wait_s:
                return self._handoff_failed(engine, request, "no_blocks")
            decode = self.workers[request.route.decode.url]
            retry = functools.partial(self._try_reserve, request=request)
            self.events.at(self.events.now + ROOM_POLL_S, lambda _: decode.post(retry))
            return []
        request.reservation = reservation
        assert request.route.prefill is not None
        prefill = self.workers[request.route.prefill.url]
        prefill.load.request_started()
        self._by_id[("prefill", request.request_id)] = request
        first = replaced(request.params, max_tokens=1, min_tokens=0)
        prefill.post(lambda e: _admit_holding(e, request.request_id, request.prompt, first))
        return []

    def _adopt(self, engine: LLMEngine, request: SimRequest, first: Sampled) -> list[RequestOutput]:
        try:
            return engine.adopt(request.request_id, first)
        except LeaseError:
            return self._handoff_failed(engine, request, "lease_expired")
        except InvalidRequestError:
            return self._handoff_failed(engine, request, "bad_handoff")

    def _handoff_failed(
        self, engine: LLMEngine, request: SimRequest, code: str
    ) -> list[RequestOutput]:
        """The pool's failure policy: prefill here after all, or end the request."""
        self.handoff_failures[code] = self.handoff_failures.get(code, 0) + 1
        if self.failure_policy == "fail":
            request.record.fail(f"HTTP 503: hand-off failed ({code})", self.events.now)
            self._ended(request, self.events.now)
            return []
        request.record.mode = "colocated"
        return self._admit(engine, request)

    # -- steps and outputs ---------------------------------------------------------------

    def _stepped(self, worker: SimWorker, result: StepResult, now: float) -> None:
        side = "prefill" if worker.role == "prefill" else "decode"
        for output in result.outputs:
            request = self._by_id.get((side, output.request_id))
            if request is None:
                continue
            if side == "prefill":
                self._prefilled(worker, request, output, now)
            else:
                self._streamed(request, output, now)
        for failure in result.failed:
            request = self._by_id.get((side, failure.request_id))
            if request is None:
                continue
            if side == "prefill":
                self._prefill_failed(worker, request)
            else:
                request.record.fail(f"HTTP 503: {failure}", now)
                self._ended(request, now)

    def _prefill_failed(self, prefill: SimWorker, request: SimRequest) -> None:
        """The prefill worker could not compute the prompt: the decode worker frees
        its reservation and follows the failure policy."""
        del self._by_id[("prefill", request.request_id)]
        prefill.load.request_ended()

        def settle(engine: LLMEngine) -> list[RequestOutput]:
            engine.release(request.request_id)
            return self._handoff_failed(engine, request, "prefill_failed")

        self.workers[request.route.decode.url].post(settle)

    def _streamed(self, request: SimRequest, output: RequestOutput, now: float) -> None:
        record = request.record
        if output.new_token_ids:
            self._answered(request)
            record.chunk_times.append(now)
            record.chunk_tokens.append(len(output.new_token_ids))
            if self.host is not None:
                self.host.tokens_streamed(now, len(output.new_token_ids))
        if output.finished:
            record.usage_prompt_tokens = output.num_prompt_tokens
            record.usage_cached_tokens = output.num_cached_tokens
            record.usage_completion_tokens = output.num_output_tokens
            record.finished = True
            self._ended(request, now)

    def _prefilled(
        self, worker: SimWorker, request: SimRequest, output: RequestOutput, now: float
    ) -> None:
        """The prefill worker drew the first token: the KV goes over, then the decode
        worker adopts it and the prefill worker lets its blocks go."""
        if not output.finished:
            return
        del self._by_id[("prefill", request.request_id)]
        assert request.reservation is not None
        nbytes = len(request.reservation.block_ids) * worker.block_bytes
        first = Sampled(list(output.new_token_ids))
        decode = self.workers[request.route.decode.url]

        def delivered(at: float) -> None:
            worker.post(lambda engine: _release(engine, request.request_id))
            worker.load.request_ended()
            decode.post(lambda engine: self._adopt(engine, request, first))

        self.events.at(now + self.profile.handoff.seconds(nbytes), delivered)


def _admit_holding(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    """A prefill worker's request: the prompt and its first token, blocks kept."""
    engine.add_request(request_id, prompt, params, hold_blocks=True)
    return []


def _release(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    engine.release(request_id)
    return []
