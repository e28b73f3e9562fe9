"""Log-probabilities of tokens, as the engine reports them for sampled tokens and for
the tokens of a prompt.

Two modes, as vLLM's `--logprobs-mode` names them: `raw_logprobs` (the default) are
the log-softmax of the model's own logits; `processed_logprobs` are those of the
distribution the sampler draws from, after the request's min_tokens, temperature,
top-k and top-p (tokens those cut off get -inf). Log-softmax is computed only for the
rows of requests that ask for log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token, its log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens more likely than this one
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), best first


# A prompt's log-probabilities: None for its first token (nothing precedes it).
PromptLogprobs = tuple[TokenLogprob | None, ...]


def token_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """For each row of `logprobs` [R, vocab]: the log-probability and rank of
    `token_ids[row]` and the `num_top[row]` most likely tokens."""
    if not token_ids:
        return []
    column = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, column)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    widest = min(max(num_top), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(widest, dim=1)
    values, top_v, top_i = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    token_ids = [int(token) for token in token_ids]
    rows = zip(token_ids, values, ranks.tolist(), num_top, top_i, top_v, strict=True)
    return [
        TokenLogprob(token, value, rank, tuple(zip(ids[:k], vals[:k], strict=True)))
        for token, value, rank, k, ids, vals in rows
    ]
