"""Fault isolation's parts: bisection pins a step's failure on the requests that cause
it and lets engine faults through; sampling parameters are checked in the precision
the sampler computes in; a row that cannot be drawn fails alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from pdserve.protocol.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.engine.isolation import is_engine_fault, run_isolated
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.sampler import Sampled, Sampler

REQUESTS = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(8)]


def tokens(request: Request) -> int:
    return 1


def failing_for(
    poisoned: set[str], error: Exception
) -> tuple[list[list[str]], Callable[[Sequence[Request]], list[str]]]:
    """A step function that raises `error` whenever its chunks include a poisoned
    request, and the list of the chunk sets it ran."""
    calls: list[list[str]] = []

    def run(chunks: Sequence[Request]) -> list[str]:
        names = [chunk.request_id for chunk in chunks]
        calls.append(names)
        if poisoned & set(names):
            raise error
        return names

    return calls, run


def test_bisection_fails_only_the_poisoned_requests() -> None:
    calls, run = failing_for({"r2", "r5"}, ValueError("bad row"))
    ran = run_isolated(run, REQUESTS, lambda r: r, tokens)
    assert sorted(f.request.request_id for f in ran.failures) == ["r2", "r5"]
    done = sorted(name for result in ran.results for name in result)
    assert done == ["r0", "r1", "r3", "r4", "r6", "r7"]
    assert ran.bisected
    assert len(calls) < 2 * len(REQUESTS)  # halves, not one run per request


def test_a_step_that_runs_is_run_once() -> None:
    calls, run = failing_for(set(), ValueError("never"))
    ran = run_isolated(run, REQUESTS, lambda r: r, tokens)
    assert calls == [[r.request_id for r in REQUESTS]]
    assert not ran.failures and not ran.bisected


def test_a_lost_device_stops_the_engine() -> None:
    _, run = failing_for({"r3"}, RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="CUDA error"):
        run_isolated(run, REQUESTS, lambda r: r, tokens)


def test_out_of_memory_is_the_engines_only_at_the_smallest_step() -> None:
    oom = torch.OutOfMemoryError("out of memory")
    assert is_engine_fault(oom, num_tokens=1)
    assert not is_engine_fault(oom, num_tokens=512)
    assert not is_engine_fault(ValueError("x"), num_tokens=1)
    # A large step that runs out of memory is run in halves, which fit.
    calls: list[int] = []

    def run(chunks: Sequence[Request]) -> int:
        calls.append(len(chunks))
        if len(chunks) > 2:
            raise oom
        return len(chunks)

    ran = run_isolated(run, REQUESTS, lambda r: r, lambda r: 100)
    assert not ran.failures
    assert sum(ran.results) == len(REQUESTS)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6, -0.0, 0.0])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.greedy


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_top_p_that_rounds_to_zero_in_float32_is_refused(top_p: float) -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p .* rounds to 0"):
        SamplingParams(top_p=top_p).validate()


def test_the_smallest_float32_top_p_keeps_the_most_likely_token() -> None:
    SamplingParams(top_p=1e-45).validate()
    sampler = Sampler("cpu", 0, frozenset())
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    request = Request("r", [1], SamplingParams(top_p=1e-45, temperature=1.0))
    (drawn,) = sampler.sample(logits, [request])
    assert isinstance(drawn, Sampled) and drawn.tokens == [1]


def test_top_p_truncates_the_distribution() -> None:
    sampler = Sampler("cpu", 0, frozenset())
    # Token 1 holds about 0.84 of the mass: top_p 0.5 keeps it alone, 0.9 two tokens.
    logits = torch.tensor([[0.0, 4.0, 0.0, 2.3]])
    narrow = [Request(f"n{i}", [1], SamplingParams(top_p=0.5)) for i in range(200)]
    wide = [Request(f"w{i}", [1], SamplingParams(top_p=0.9)) for i in range(200)]
    drawn = sampler.sample(logits.expand(400, -1), narrow + wide)
    narrow_tokens = {d.tokens[0] for d in drawn[:200] if isinstance(d, Sampled)}
    wide_tokens = {d.tokens[0] for d in drawn[200:] if isinstance(d, Sampled)}
    assert narrow_tokens == {1}
    assert wide_tokens == {1, 3}


def test_a_row_that_cannot_be_drawn_fails_alone() -> None:
    sampler = Sampler("cpu", 0, frozenset())
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 1.0, 0.0], [2.0, 1.0, 0.0]])
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    first, broken, last = sampler.sample(logits, requests)
    assert isinstance(first, Sampled) and isinstance(last, Sampled)
    assert isinstance(broken, RuntimeError)
