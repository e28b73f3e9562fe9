"""The engine core: requests in, one step at a time, tokens out. Synchronous and
single-threaded; `async_engine` runs it in a thread behind an asyncio front."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pdserve.protocol.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.engine.budget import budget_policy
from pdserve.workers.engine.canary import KVCanary, pattern_from_environment
from pdserve.workers.engine.choices import (
    add_prompt_logprobs,
    all_ended,
    finished_request,
    fork,
    prompt_logprobs,
)
from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import EngineConfig, ModelConfig
from pdserve.workers.engine.isolation import (
    Isolated,
    RequestFailedError,
    RequestFailure,
    is_engine_fault,
    run_isolated,
)
from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.workers.engine.leases import LeaseBook, LeaseError, Reservation
from pdserve.workers.engine.logprobs import PromptLogprobs
from pdserve.workers.engine.request import FinishReason, Request, RequestStatus
from pdserve.workers.engine.runner import (
    ModelRunner,
    RunnerFactory,
    StepOutput,
    resolve_kv_dtype,
)
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from pdserve.workers.engine.stats import FinishedRequest, RequestOutput, StepStats
from pdserve.workers.engine.step_cost import StepCostModel, StepFeatures

log = logging.getLogger(__name__)
# One DEBUG line per step: the chunks it ran, in order (request id, start, tokens).
step_log = logging.getLogger("pdserve.workers.engine.steps")
# Each step's budget, predicted and measured time, and gap since the last tokens.
timing_log = logging.getLogger("pdserve.workers.engine.step_timing")
Result = TypeVar("Result")


@dataclass(frozen=True)
class StepResult:
    """Everything one step produced."""

    outputs: list[RequestOutput]
    stats: StepStats
    finished: list[FinishedRequest] = field(default_factory=list)
    # Requests that failed in the step (each alone: the others went on).
    failed: list[RequestFailedError] = field(default_factory=list)
    # What the step computed, in the scheduler's order.
    chunks: tuple[ScheduledChunk, ...] = ()


class LLMEngine:
    """A model, its KV cache and its scheduler.

    By default the model's config.json is read from the model directory, steps run
    the model, and time is `time.monotonic`. The planner passes the model's
    configuration, a runner that takes each step's duration from a profile, and the
    clock that runner advances: the same scheduling, budget and bookkeeping, on a
    simulated clock."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        runner: RunnerFactory = ModelRunner,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.model_config = model_config or ModelConfig.from_dir(config.model_dir)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        cache = config.cache
        self.block_size = cache.block_size
        itemsize = resolve_kv_dtype(config, self.model_config).itemsize
        self.num_blocks = cache.resolve_num_blocks(self.model_config, itemsize)
        self.runner = runner(config, self.model_config, self.num_blocks, self.block_size)
        pattern = pattern_from_environment()
        self.canary = None if pattern is None else KVCanary(self.runner.kv_cache, pattern)
        if self.canary is not None:
            log.warning("KV canary on: free blocks hold %s until handed out", pattern)
            self.canary.freed(range(self.num_blocks))
        self.kv_cache = KVCacheManager(
            BlockPool(self.num_blocks, cache.enable_prefix_caching, self.canary),
            self.block_size,
            cache.hash_seed,
        )
        # The cost model learns in every mode: its metrics show a static pool what an
        # adaptive budget would believe.
        self.step_cost = StepCostModel()
        self.budget_policy = budget_policy(
            config.scheduler, self.max_model_len, self.step_cost, clock
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, self.max_model_len, self.budget_policy, clock
        )
        self.target_itl_s = config.scheduler.token_budget.target_itl_s
        # When the last step ended, if requests were still running: their last tokens.
        self._last_busy_end: float | None = None
        self.leases = LeaseBook(self.kv_cache, clock)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}

    # -- requests --------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the request can never be served. Pure: safe to
        call from any thread."""
        params.validate()
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= token < vocab for token in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for token in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})")
        self._check_choices(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        total = num_prompt + max_tokens
        # A prompt that samples must leave room for the token it samples.
        longest_prompt = self.max_model_len - (1 if max_tokens else 0)
        if num_prompt > longest_prompt or total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the request has {num_prompt} prompt tokens and asks for {max_tokens} "
                f"more (max_tokens), {total} in all"
            )
        capacity = self.num_blocks * self.block_size
        if total > capacity:
            raise InvalidRequestError(
                f"the request needs KV cache for {total} tokens "
                f"({num_prompt} prompt + {max_tokens} max_tokens), more than the "
                f"{capacity} tokens this worker's KV cache holds"
            )

    def _check_choices(self, params: SamplingParams) -> None:
        """The parts of a request the batch and the vocabulary bound: n and the widths
        of its log-probabilities (the server's own limits are usually lower)."""
        seats = self.config.scheduler.max_num_seqs
        if params.n > seats:
            raise InvalidRequestError(
                f"n must not exceed the running batch's {seats} sequences (--max-num-seqs)"
            )
        vocab = self.model_config.vocab_size
        widths = {"logprobs": params.logprobs, "prompt_logprobs": params.prompt_logprobs}
        for name, width in widths.items():
            if width is not None and width > vocab:
                raise InvalidRequestError(f"{name} must not exceed the vocabulary ({vocab})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        hold_blocks: bool = False,
        label: str | None = None,
    ) -> Request:
        """Validate and queue a request. With `hold_blocks` its KV blocks outlive it
        (under a lease, see `held_blocks`): a prefill worker sends them afterwards.
        `label` is the client's name for it (logs, faults aimed at one request)."""
        request = self._new_request(request_id, prompt_token_ids, params)
        request.hold_blocks = hold_blocks
        request.label = label
        self.scheduler.add(request)
        return request

    def _new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Request:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if params.max_tokens is None:
            # Up to the context, and never more than the KV cache holds: a request
            # larger than the cache would preempt itself forever.
            limit = min(self.max_model_len, self.num_blocks * self.block_size)
            params = replace(params, max_tokens=limit - len(prompt_token_ids))
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=self.clock())
        self._requests[request_id] = request
        return request

    # -- P/D hand-off ------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lease_s: float,
        margin_s: float = 0.0,
    ) -> Reservation | None:
        """Decode side: reserve blocks for a prompt a prefill worker will compute.
        Blocks already here (prefix cache) are kept and need no transfer. The blocks
        can be adopted for `lease_s` seconds and stay allocated `margin_s` longer
        unless released (a late write must not land in freed blocks). None when the
        cache has no room now."""
        request = self._new_request(request_id, prompt_token_ids, params)
        cached = self.kv_cache.find_cached_prefix(request_id, request.prompt_token_ids)
        if not self.kv_cache.allocate(request_id, request.num_prompt_tokens):
            self.kv_cache.free(request_id)
            self._forget(request)
            return None
        request.num_cached_tokens = cached
        lease = self.leases.hold(request, lease_s, margin_s)
        first_block = cached // self.block_size
        return Reservation(
            request_id=request_id,
            block_ids=self.kv_cache.block_table(request_id)[first_block:],
            first_block=first_block,
            num_cached_tokens=cached,
            deadline=lease.deadline,
            hold_until=lease.hold_until,
        )

    def adopt(
        self, request_id: str, first: Sampled, prompt: PromptLogprobs | None = None
    ) -> list[RequestOutput]:
        """Decode side: the reserved blocks now hold the prompt's KV (the write is
        over); continue the request from its first token (one per choice for n > 1:
        it forks here; none for max_tokens 0) as if it had been prefilled here, with
        the log-probabilities the prefill worker computed. If the lease is gone
        (LeaseError) or the tokens do not fit the request (InvalidRequestError), the
        blocks are freed and the request ends."""
        try:
            self._check_first(request_id, first, prompt)
            request = self.leases.take(request_id)
        except (LeaseError, InvalidRequestError):
            self.release(request_id)
            raise
        if prompt is not None and request.prompt_logprobs is not None:
            request.prompt_logprobs = [entry for entry in prompt[1:] if entry is not None]
        request.num_computed_tokens = request.num_prompt_tokens
        request.first_scheduled_time = self.clock()
        self.kv_cache.cache_full_blocks(
            request_id, request.prompt_token_ids, request.num_computed_tokens
        )
        self.scheduler.add_running(request)
        failed: list[RequestFailedError] = []
        outputs, _ = self._take_sampled([(request, first)], self.clock(), failed)
        if failed:
            raise failed[0]
        return outputs

    def _check_first(self, request_id: str, first: Sampled, prompt: PromptLogprobs | None) -> None:
        """The drawn tokens' count (n, or none for max_tokens 0) and range; prompt
        log-probabilities, if any, one per prompt token."""
        request = self._requests.get(request_id)
        if request is None or request_id not in self.leases:
            raise LeaseError(f"no lease for request {request_id!r} (unknown or expired)")
        expected = request.params.n if request.samples else 0
        if len(first.tokens) != expected:
            raise InvalidRequestError(f"{len(first.tokens)} first tokens, {expected} expected")
        vocab = self.model_config.vocab_size
        if any(not 0 <= token < vocab for token in first.tokens):
            raise InvalidRequestError(f"first tokens must be in [0, {vocab})")
        if prompt is not None and len(prompt) != request.num_prompt_tokens:
            raise InvalidRequestError("prompt log-probabilities do not match the prompt")

    def held_blocks(self, request_id: str) -> list[int]:
        """Prefill side: the blocks of a finished request that holds them (in prompt
        order). Raises LeaseError if its lease is gone."""
        if request_id not in self.leases:
            raise LeaseError(f"no lease for request {request_id!r} (unknown or expired)")
        return self.kv_cache.block_table(request_id)

    def release(self, request_id: str) -> None:
        """Either side: end a hand-off's lease and free its blocks now (on the decode
        side: once no write into them can still be running)."""
        request = self.leases.release(request_id)
        if request is not None:
            self._forget(request)

    def expire_leases(self) -> int:
        """Free blocks held past their lease and its margin; how many leases ended."""
        expired = self.leases.expire()
        for request in expired:
            self._forget(request)
        return len(expired)

    def abort(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """End a request at once and free its blocks, or only its choice `index`;
        None if it is not known (or that choice does not exist yet)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if index is not None and request.params.n > 1:
            return self._abort_choice(request, index)
        if request_id in self.leases:
            self.leases.release(request_id)
        # The request itself too once it forked: a failure can strike mid-fork.
        for part in [*(request.choices or ()), request]:
            self.scheduler.finish(part, FinishReason.ABORT)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or FinishReason.ABORT
        self._forget(request)
        return self._output(request, (), self.clock())

    def _abort_choice(self, request: Request, index: int) -> RequestOutput | None:
        if request.choices is None or not 0 <= index < len(request.choices):
            return None
        choice = request.choices[index]
        self.scheduler.finish(choice, FinishReason.ABORT)
        if all_ended(request):
            self._forget(request)
        return self._output(choice, (), self.clock())

    def expire_queued(self, max_wait_s: float) -> list[str]:
        """End the requests that have waited more than `max_wait_s` for their first
        step (a preempted request has had one); their ids."""
        now = self.clock()
        expired = [
            request
            for request in self.scheduler.waiting
            if request.first_scheduled_time is None and now - request.arrival_time > max_wait_s
        ]
        for request in expired:
            self.scheduler.finish(request, FinishReason.ABORT)
            self._forget(request)
        return [request.request_id for request in expired]

    def publish_prefix_events(self) -> None:
        """Tell the prefix cache's watcher that the changes so far are complete (once per
        step, not per block: see `kv_events`)."""
        watcher = self.kv_cache.pool.prefix_watcher
        if watcher is not None:
            watcher.publish()

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs (leases are not work: they wait)."""
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, run the model, sample, and account for one step. A request that
        fails in it ends alone (see `isolation`): its blocks are freed and the step
        reports it in `failed`; the others go on."""
        started = self.clock()
        newly_scheduled = list(self.scheduler.waiting)
        output = self.scheduler.schedule()
        queries, hits = _prefix_lookups(newly_scheduled, output.chunks)
        features = StepFeatures.of(output.chunks)
        predicted = self.step_cost.predict(features)
        ran = self._execute(output) if output.chunks else None
        failures = [] if ran is None else [*ran.failures, *ran.results[0].failures]
        failed = self._fail_all(failures)
        self._account(output, failed)
        now = self.clock()
        outputs: list[RequestOutput] = []
        finished: list[FinishedRequest] = []
        if ran is not None:
            if not ran.bisected:  # a step run again in parts says nothing of its cost
                self.step_cost.update(features, now - started)
            step_output = ran.results[0]
            for request, first_token, entries in step_output.prompt_logprobs:
                add = functools.partial(add_prompt_logprobs, request, first_token, entries)
                self._guard(request, failed, add)
            outputs, finished = self._take_sampled(step_output.sampled, now, failed)
        interval = now - (self._last_busy_end or started)
        self._last_busy_end = now if self.has_unfinished() else None
        self.budget_policy.step_ended(self._last_busy_end)
        stats = self._stats(
            now,
            duration_s=now - started,
            num_tokens=output.num_tokens,
            num_decode_tokens=sum(1 for c in output.chunks if not c.is_prefill),
            num_prefill_chunks=output.num_prefill_chunks,
            num_preemptions=len(output.preempted),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            token_budget=output.token_budget,
            predicted_duration_s=predicted,
            over_target=self._over_target(features, interval),
        )
        if step_log.isEnabledFor(logging.DEBUG):
            step_log.debug("step %s", describe_chunks(output.chunks))
        if timing_log.isEnabledFor(logging.DEBUG):
            timing_log.debug(
                "budget=%d tokens=%d predicted=%.1fms took=%.1fms since_last_tokens=%.1fms",
                output.token_budget, output.num_tokens, 1e3 * predicted, 1e3 * (now - started),
                1e3 * interval,
            )  # fmt: skip
        return StepResult(outputs, stats, finished, failed, output.chunks)

    def _execute(self, output: SchedulerOutput) -> Isolated[StepOutput]:
        """Run the step's chunks, in parts if one of them fails (see `isolation`); the
        parts' outputs merged into one."""

        def run(chunks: Sequence[ScheduledChunk]) -> StepOutput:
            part = replace(output, chunks=tuple(chunks))
            return self.runner.execute(part, self.kv_cache.block_table)

        ran = run_isolated(run, output.chunks, _request_of, _tokens_of)
        return replace(ran, results=[StepOutput.merged(ran.results)])

    def _account(self, output: SchedulerOutput, failed: list[RequestFailedError]) -> None:
        """Progress and full blocks of the step's chunks whose requests did not fail
        (a failed request's KV is never offered to the prefix cache)."""
        for chunk in output.chunks:
            if not chunk.request.is_finished:
                update = functools.partial(self.scheduler.update_chunk, chunk)
                self._guard(chunk.request, failed, update)

    def _guard(
        self, request: Request, failed: list[RequestFailedError], action: Callable[[], Result]
    ) -> Result | None:
        """Run one request's part of the step; an error (unless it is the engine's)
        ends that request alone, at once, and is added to `failed`."""
        if request.is_finished:
            return None  # it failed earlier in this step
        try:
            return action()
        except Exception as error:
            if is_engine_fault(error, num_tokens=1):
                raise
            failed.extend(self._fail_all([RequestFailure(request, error)]))
            return None

    def _fail_all(self, failures: list[RequestFailure]) -> list[RequestFailedError]:
        """End each failed request whole (all its choices), freeing its blocks and any
        lease; one error per request."""
        failed: list[RequestFailedError] = []
        for failure in failures:
            whole = failure.request.parent or failure.request
            if self._requests.get(whole.request_id) is not whole:
                continue  # already ended in this step
            error = RequestFailedError(whole.request_id, failure.error)
            level = logging.WARNING if error.invalid else logging.ERROR
            log.log(level, "%s (client id %s)", error, whole.label, exc_info=failure.error)
            self.abort(whole.request_id)
            failed.append(error)
        return failed

    def _take_sampled(
        self,
        sampled: list[tuple[Request, Sampled]],
        now: float,
        failed: list[RequestFailedError],
    ) -> tuple[list[RequestOutput], list[FinishedRequest]]:
        """Append what each request drew and end the requests that stop; a request
        with n > 1 forks into its choices at its first draw. A request whose draw
        cannot be taken fails alone (added to `failed`)."""
        outputs: list[RequestOutput] = []
        finished: list[FinishedRequest] = []
        for request, drawn in sampled:
            take = functools.partial(self._take_one, request, drawn, now, finished)
            outputs.extend(self._guard(request, failed, take) or [])
        return outputs, finished

    def _take_one(
        self, request: Request, drawn: Sampled, now: float, finished: list[FinishedRequest]
    ) -> list[RequestOutput]:
        """The outputs of one request's draw (one per choice when it forks)."""
        if request.forks:
            return self._fork(request, drawn, now, finished)
        first = not request.output_token_ids
        request.output_token_ids.extend(drawn.tokens)
        reason = self._end_reason(request)
        if reason is not None:
            self._end(request, reason, now, finished)
        return [self._output(request, tuple(drawn.tokens), now, drawn, first)]

    def _fork(
        self, parent: Request, drawn: Sampled, now: float, finished: list[FinishedRequest]
    ) -> list[RequestOutput]:
        """Turn a request whose prompt is computed into its n choices, each with its
        first token. The choices that go on share the prompt's blocks (the partial
        last one copied for all but one); if none goes on, the request's blocks are
        freed, or held for their transfer on a prefill worker."""
        choices = fork(parent, drawn.tokens)
        reasons = [self._end_reason(choice) for choice in choices]
        going = [choice for choice, reason in zip(choices, reasons, strict=True) if reason is None]
        if going:
            placed, copies = self.kv_cache.fork(
                parent.request_id, [c.request_id for c in going], parent.num_computed_tokens
            )
            self.runner.copy_blocks(copies)
            waiting = going[len(placed) :]
            for choice in waiting:  # no block for its copy: it computes the prompt again
                choice.num_computed_tokens = 0
            self.scheduler.fork(parent, going[: len(placed)], waiting)
        else:
            self._end(parent, reasons[-1] or FinishReason.LENGTH, now, [])
        outputs = []
        # Ended one by one, so that only the last output says the request ended.
        for choice, reason in zip(choices, reasons, strict=True):
            if reason is not None:
                self._end(choice, reason, now, finished)
            tokens = tuple(choice.output_token_ids)
            outputs.append(self._output(choice, tokens, now, drawn.of_choice(choice.index), True))
        return outputs

    def _end_reason(self, request: Request) -> FinishReason | None:
        """Why a request ends with the token it just drew (LENGTH when it draws none:
        max_tokens 0), or None."""
        if not request.output_token_ids:
            return FinishReason.LENGTH
        return self._stop_reason(request, request.output_token_ids[-1])

    def _end(
        self, request: Request, reason: FinishReason, now: float, finished: list[FinishedRequest]
    ) -> None:
        """Finish a request or a choice; once the whole request ended, report it."""
        self.scheduler.finish(request, reason, free_blocks=not request.hold_blocks)
        if request.hold_blocks:
            self.leases.hold(request, self.config.handoff_lease_s)
        whole = request.parent or request
        if all_ended(whole):
            finished.append(finished_request(whole, reason, now))
            if not whole.hold_blocks:
                self._forget(whole)

    def _over_target(self, features: StepFeatures, interval: float) -> bool:
        """Whether the step's decodes waited longer than the ITL target for its tokens."""
        target = self.target_itl_s
        return target is not None and features.decode_tokens > 0 and interval > target

    def snapshot(self) -> StepResult:
        """The engine's state without running a step (after aborts, while idle)."""
        return StepResult([], self._stats(self.clock()))

    def _stats(self, now: float, **step: int | float) -> StepStats:
        counters: dict[str, int | float] = {
            "duration_s": 0.0,
            "num_tokens": 0,
            "num_decode_tokens": 0,
            "num_prefill_chunks": 0,
            "num_preemptions": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
        }
        counters.update(step)
        return StepStats(
            time=now,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.pool.usage,
            leases_expired_total=self.leases.num_expired,
            kv_blocks_allocated_total=self.kv_cache.pool.num_allocated_total,
            step_cost=self.step_cost.estimate(),
            **counters,  # type: ignore[arg-type]
        )

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    @staticmethod
    def _output(
        request: Request,
        tokens: tuple[int, ...],
        now: float,
        drawn: Sampled | None = None,
        first: bool = False,
    ) -> RequestOutput:
        """A choice's output (or a request's); `first`: its first, which carries the
        prompt's log-probabilities."""
        whole = request.parent or request
        logprobs = drawn.logprobs if drawn is not None else None
        return RequestOutput(
            request_id=whole.request_id,
            new_token_ids=tokens,
            finished=all_ended(whole),
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            time=now,
            index=request.index,
            logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=prompt_logprobs(whole) if first else None,
        )


def _prefix_lookups(candidates: list[Request], chunks: Sequence[ScheduledChunk]) -> tuple[int, int]:
    """Prompt tokens looked up in the prefix cache by requests admitted this step,
    and how many of them were found (a request scoring its prompt looks up nothing)."""
    admitted = {chunk.request for chunk in chunks}
    fresh = [
        r
        for r in candidates
        if r in admitted
        and r.num_preemptions == 0
        and r.parent is None
        and r.params.prompt_logprobs is None
    ]
    return sum(r.num_prompt_tokens for r in fresh), sum(r.num_cached_tokens for r in fresh)


def describe_chunks(chunks: Sequence[ScheduledChunk]) -> str:
    """A step's chunks as its log line shows them: `id@start+tokens`, in order."""
    return " ".join(f"{c.request.request_id}@{c.start}+{c.num_tokens}" for c in chunks)


def _request_of(chunk: ScheduledChunk) -> Request:
    return chunk.request


def _tokens_of(chunk: ScheduledChunk) -> int:
    return chunk.num_tokens
