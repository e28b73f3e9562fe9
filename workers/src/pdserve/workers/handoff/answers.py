"""Checking what a prefill worker drew against what the decode worker asked for: the
first tokens (one per choice, none when only the prompt's log-probabilities were
asked for) and the log-probabilities, of the right tokens and as wide as asked.
Each problem is named; any one fails the hand-off."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.handoff.protocol import PrefillAnswer, WireLogprob


def drawn_inconsistencies(
    answer: PrefillAnswer, prompt: Sequence[int], params: SamplingParams, vocab: int
) -> list[str]:
    """What in the drawn part of a well-formed answer contradicts the request."""
    problems = []
    tokens = answer.first_tokens
    expected = params.n if params.max_tokens != 0 else 0
    if len(tokens) != expected:
        problems.append(f"{len(tokens)} first tokens, {expected} expected")
    outside = [token for token in tokens if token >= vocab]
    if outside:
        problems.append(f"first token {outside[0]} is outside the vocabulary (< {vocab})")
    problems += _logprobs_problems("logprobs", answer.logprobs, tokens, params.logprobs, vocab)
    expected_prompt: list[int | None] = [None, *prompt[1:]]
    problems += _logprobs_problems(
        "prompt_logprobs", answer.prompt_logprobs, expected_prompt, params.prompt_logprobs, vocab
    )
    return problems


def _logprobs_problems(
    name: str,
    entries: Sequence[WireLogprob | None] | None,
    tokens: Sequence[int | None],
    width: int | None,
    vocab: int,
) -> list[str]:
    """The first problem with log-probabilities that should be those of `tokens`
    (None: no entry there), each with `width` alternatives (None: none asked for)."""
    if width is None:
        return [] if entries is None else [f"{name} sent, none asked for"]
    if entries is None:
        return [f"{name} asked for and missing"]
    if len(entries) != len(tokens):
        return [f"{len(entries)} {name} entries for {len(tokens)} tokens"]
    for entry, token in zip(entries, tokens, strict=True):
        if entry is None or token is None:
            if (entry is None) != (token is None):
                return [f"{name}: an entry where none belongs, or none where one does"]
            continue
        if entry.token_id != token:
            return [f"{name} of token {entry.token_id} where the token is {token}"]
        if len(entry.top_ids) != min(width, vocab):
            return [f"{name} with {len(entry.top_ids)} alternatives, {width} asked for"]
        if entry.rank > vocab or any(top >= vocab for top in entry.top_ids):
            return [f"{name} beyond the vocabulary (< {vocab})"]
    return []
