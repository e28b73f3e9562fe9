"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded; and the
log-probabilities of what was drawn, for the requests that ask for them."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers import faults
from pdserve.workers.engine.isolation import is_engine_fault
from pdserve.workers.engine.logprobs import LogprobsMode, TokenLogprob, token_logprobs
from pdserve.workers.engine.request import Request


@dataclass(frozen=True)
class Sampled:
    """What one request drew in a step: one token, or one per choice at the step a
    request with n > 1 forks; with their log-probabilities when asked for."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None

    def of_choice(self, index: int) -> Sampled:
        """What choice `index` of a forking request drew."""
        logprobs = None if self.logprobs is None else self.logprobs[index : index + 1]
        return Sampled(self.tokens[index : index + 1], logprobs)


class Sampler:
    """Samples tokens from rows of logits. A seeded request draws each token with a
    generator seeded from its seed and the token's position, so its tokens depend
    neither on what else is in the batch nor on where its earlier tokens were drawn
    (a prefill worker, before a preemption). Choice i of a request with n > 1 draws
    as a request with seed + i."""

    def __init__(
        self,
        device: str,
        seed: int,
        eos_token_ids: frozenset[int],
        logprobs_mode: LogprobsMode = "raw_logprobs",
    ) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.logprobs_mode = logprobs_mode
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sampled | Exception]:
        """What each request draws from its row of float32 logits [N, vocab], or the
        error its row raised: one request's failure to draw is its own."""
        greedy = _argmax_rows(logits)
        raw = self._raw_logprobs(logits, requests)
        drawn: list[Sampled | Exception] = []
        for row, request in enumerate(requests):
            try:
                drawn.append(self._sample_row(logits[row], greedy[row], raw.get(row), request))
            except Exception as error:
                if is_engine_fault(error, num_tokens=1):
                    raise
                drawn.append(error)
        return drawn

    def _sample_row(
        self, row_logits: torch.Tensor, greedy: int, raw: torch.Tensor | None, request: Request
    ) -> Sampled:
        """One request's draw from its row of logits (never written in place: they may
        be an inference-mode tensor)."""
        faults.blocking_point("engine.sample", labels=(request.label,))
        params = request.params
        if len(request.output_token_ids) < params.min_tokens:
            row_logits = self._suppress_stops(row_logits, request)
            greedy = int(row_logits.argmax())
        if params.greedy:
            tokens = [greedy] * (params.n if request.forks else 1)
        else:
            position = len(request.output_token_ids)
            tokens = [self._draw(row_logits, choice, position) for choice in _draws(request)]
        logprobs = None
        if params.logprobs is not None:
            source = raw if raw is not None else self.processed(row_logits, params)
            width = [params.logprobs] * len(tokens)
            logprobs = token_logprobs(source.expand(len(tokens), -1), tokens, width)
        return Sampled(tokens, logprobs)

    def processed(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Log-probabilities of the distribution a request draws from, for rows of
        logits [..., vocab]: after temperature, top-k and top-p (a greedy request's
        is the model's own)."""
        if params.greedy:
            return torch.log_softmax(logits, dim=-1)
        return torch.log(_distribution(logits, params))

    def _raw_logprobs(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> dict[int, torch.Tensor]:
        """Log-softmax of the rows of requests asking for raw log-probabilities, by row."""
        if self.logprobs_mode != "raw_logprobs":
            return {}
        rows = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return {}
        index = torch.tensor(rows, device=logits.device)
        values = torch.log_softmax(logits[index], dim=-1)
        return {row: values[i] for i, row in enumerate(rows)}

    def _draw(self, row: torch.Tensor, params: SamplingParams, position: int) -> int:
        probs = _distribution(row, params)
        return int(torch.multinomial(probs, 1, generator=self._generator(params.seed, position)))

    def _generator(self, seed: int | None, position: int) -> torch.Generator:
        if seed is None:
            return self._shared
        self._seeded.manual_seed(draw_seed(seed, position))
        return self._seeded

    def _suppress_stops(self, row: torch.Tensor, request: Request) -> torch.Tensor:
        """Hide end-of-sequence and stop tokens until min_tokens are out."""
        banned = sorted(set(request.params.stop_token_ids) | self.eos_token_ids)
        if not banned:
            return row
        mask = torch.zeros_like(row, dtype=torch.bool)
        mask[torch.tensor(banned, device=row.device)] = True
        return row.masked_fill(mask, float("-inf"))


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """The most likely token of each row (the first of ties, as torch's). On the CPU
    through numpy: torch's argmax over a batch of vocabulary rows costs several times
    as much, and it runs every step for every sequence."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        found: list[int] = logits.numpy().argmax(axis=-1).tolist()
        return found
    return [int(token) for token in logits.argmax(dim=-1).tolist()]


def _draws(request: Request) -> list[SamplingParams]:
    """The parameters of each token a request draws now: one per choice when it
    forks, else its own."""
    if not request.forks:
        return [request.params]
    return [request.params.choice(i) for i in range(request.params.n)]


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at `position` (0: the first
    generated): a hash, so that nearby seeds and positions draw unrelated numbers."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, for rows [..., vocab]."""
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
