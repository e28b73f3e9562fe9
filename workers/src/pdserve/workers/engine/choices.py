"""A request's choices (n > 1) and what is reported about the request as a whole.

A request with n > 1 computes its prompt once. At the step that samples its first
token it draws one token per choice and forks: each choice is a request of its own
from then on (its own block table, generator, stop and preemption), sharing the
prompt's KV blocks with its siblings. The client's request ends when every choice
has.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.workers.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.workers.engine.request import FinishReason, Request
from pdserve.workers.engine.stats import FinishedRequest


def fork(parent: Request, tokens: Sequence[int]) -> list[Request]:
    """The parent's n choices, each with its first token (none for max_tokens 0),
    its prompt computed as far as the parent's."""
    choices = [
        Request(
            request_id=parent.choice_id(index),
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params.choice(index),
            arrival_time=parent.arrival_time,
            output_token_ids=list(tokens[index : index + 1]),
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens,
            first_scheduled_time=parent.first_scheduled_time,
            index=index,
            parent=parent,
            label=parent.label,
        )
        for index in range(parent.params.n)
    ]
    parent.choices = choices
    return choices


def all_ended(request: Request) -> bool:
    """Whether a client's request is over: it ended, or every one of its choices did."""
    if request.choices is None:
        return request.is_finished
    return all(choice.is_finished for choice in request.choices)


def add_prompt_logprobs(request: Request, first_token: int, entries: list[TokenLogprob]) -> None:
    """Record prompt log-probabilities a step computed, from prompt token `first_token` on."""
    done = request.prompt_logprobs
    assert done is not None and len(done) + 1 == first_token, "prompt logprobs out of order"
    done.extend(entries)


def prompt_logprobs(request: Request) -> PromptLogprobs | None:
    """A request's prompt log-probabilities as reported (None for the first token),
    if it asked for them."""
    if request.prompt_logprobs is None:
        return None
    return (None, *request.prompt_logprobs)


def finished_request(request: Request, reason: FinishReason, now: float) -> FinishedRequest:
    """The report of a client's request that ended (its choices summed up); `reason`
    is that of the choice that ended last."""
    parts = request.choices or [request]
    return FinishedRequest(
        request_id=request.request_id,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        finish_time=now,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=sum(len(part.output_token_ids) for part in parts),
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions
        + sum(part.num_preemptions for part in request.choices or []),
        finish_reason=reason,
    )
