"""Fault isolation: what goes wrong while building, running or sampling a step for one
request fails that request, never the engine.

A step runs many requests in one forward pass, so an exception from it names none of
them. `run_isolated` finds the culprits by bisection: the step's chunks are run again
in halves (only after a failure, so the common path costs nothing), a half that runs
gives its requests' results, a half that fails is split again, and a single chunk that
still fails is its request's fault. Running a chunk again is safe: a step writes only
the KV slots of tokens not yet computed, which belong to their request alone, and
nothing is accounted until the step has run.

Some errors belong to no request and do stop the engine (`is_engine_fault`): the
device is lost, or memory runs out for a one-token decode, the smallest step there is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from pdserve.protocol.sampling import InvalidRequestError
from pdserve.workers.engine.request import Request

Chunk = TypeVar("Chunk")
Result = TypeVar("Result")

# Messages of device errors that leave the device unusable for every request.
_DEVICE_LOST = ("CUDA error", "device-side assert", "NCCL error", "CUBLAS_STATUS", "HIP error")


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (the others go on). `invalid` when its
    parameters caused it (an HTTP 400), otherwise a server error naming the request."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id} failed in the engine: {_describe(cause)}")
        self.request_id = request_id
        self.cause = cause

    @property
    def invalid(self) -> bool:
        """Whether the request's own parameters caused the failure."""
        return isinstance(self.cause, InvalidRequestError)


@dataclass(frozen=True)
class RequestFailure:
    """A request that failed in a step, and why."""

    request: Request
    error: BaseException


@dataclass(frozen=True)
class Isolated(Generic[Result]):
    """What a step gave: the results of the parts that ran (one per run), the requests
    that failed, and whether the step had to be bisected to find them."""

    results: list[Result]
    failures: list[RequestFailure]
    bisected: bool


def is_engine_fault(error: BaseException, num_tokens: int) -> bool:
    """Whether `error`, raised by a step computing `num_tokens` tokens, belongs to no
    request: the device is lost, or memory ran out for the smallest step there is (a
    larger one is run again in halves)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return num_tokens <= 1
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    message = str(error)
    return any(marker in message for marker in _DEVICE_LOST)


def run_isolated(
    run: Callable[[Sequence[Chunk]], Result],
    chunks: Sequence[Chunk],
    request_of: Callable[[Chunk], Request],
    tokens_of: Callable[[Chunk], int],
) -> Isolated[Result]:
    """Run `chunks` as one step; if that raises, run them again in halves until each
    failure is pinned on one request. Engine faults propagate."""
    try:
        return Isolated([run(chunks)], [], bisected=False)
    except Exception as error:
        if is_engine_fault(error, sum(tokens_of(chunk) for chunk in chunks)):
            raise
        if len(chunks) == 1:
            return Isolated([], [RequestFailure(request_of(chunks[0]), error)], bisected=True)
    middle = len(chunks) // 2
    first = run_isolated(run, chunks[:middle], request_of, tokens_of)
    second = run_isolated(run, chunks[middle:], request_of, tokens_of)
    return Isolated(first.results + second.results, first.failures + second.failures, True)


def _describe(error: BaseException) -> str:
    """An error's type and first line (a torch message can run to many lines)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
