"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from pdserve.workers.engine.request import Request


class Sampler:
    """Samples one token per row of logits. A request with a seed owns a generator,
    so its tokens do not depend on what else is in the batch."""

    def __init__(self, device: str, seed: int, eos_token_ids: frozenset[int]) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token for each request, from its row of float32 logits [N, vocab]."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            params = request.params
            # Never written in place: the logits may be an inference-mode tensor.
            row_logits = logits[row]
            if request.num_tokens - request.num_prompt_tokens < params.min_tokens:
                row_logits = self._suppress_stops(row_logits, request)
                tokens[row] = int(row_logits.argmax())
            if not params.greedy:
                tokens[row] = self._sample_row(row_logits, request)
        return [int(token) for token in tokens]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._seeded.pop(request_id, None)

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.params
        scaled = row / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator(request)))

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.params.seed
        if seed is None:
            return self._shared
        generator = self._seeded.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._seeded[request.request_id] = generator
        return generator

    def _suppress_stops(self, row: torch.Tensor, request: Request) -> torch.Tensor:
        """Hide end-of-sequence and stop tokens until min_tokens are out."""
        banned = sorted(set(request.params.stop_token_ids) | self.eos_token_ids)
        if not banned:
            return row
        mask = torch.zeros_like(row, dtype=torch.bool)
        mask[torch.tensor(banned, device=row.device)] = True
        return row.masked_fill(mask, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()
