"""The decode worker's check of what a prefill worker drew: one first token per
choice, log-probabilities of those tokens, as wide as asked, and only when asked."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.handoff.answers import drawn_inconsistencies
from pdserve.workers.handoff.protocol import PrefillAnswer

PROMPT = [7, 8, 9]
VOCAB = 100


def entry(token: int, width: int = 2) -> dict[str, Any]:
    return {
        "token_id": token,
        "logprob": -0.5,
        "rank": 1,
        "top_ids": list(range(width)),
        "top_logprobs": [-0.5] * width,
    }


def answer(**fields: Any) -> PrefillAnswer:
    body = {"blocks": 1, "bytes": 1, "transfer_seconds": 0.0, "descriptors": 1,
            "prefill_seconds": 0.0, "first_tokens": [5], **fields}  # fmt: skip
    return PrefillAnswer.model_validate(body)


GOOD = SamplingParams(n=2, logprobs=2, prompt_logprobs=2)
GOOD_FIELDS = {
    "first_tokens": [5, 6],
    "logprobs": [entry(5), entry(6)],
    "prompt_logprobs": [None, entry(8), entry(9)],
}


def test_an_answer_that_fits_passes() -> None:
    assert drawn_inconsistencies(answer(**GOOD_FIELDS), PROMPT, GOOD, VOCAB) == []
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=0)
    fields = {"first_tokens": [], "prompt_logprobs": [None, entry(8, 0), entry(9, 0)]}
    assert drawn_inconsistencies(answer(**fields), PROMPT, scoring, VOCAB) == []


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"first_tokens": [5]}, "1 first tokens, 2 expected"),
        ({"first_tokens": [5, 100]}, "outside the vocabulary"),
        ({"logprobs": None}, "logprobs asked for and missing"),
        ({"logprobs": [entry(5)]}, "1 logprobs entries for 2 tokens"),
        ({"logprobs": [entry(5), entry(7)]}, "of token 7 where the token is 6"),
        ({"logprobs": [entry(5), entry(6, width=3)]}, "3 alternatives, 2 asked for"),
        ({"prompt_logprobs": [entry(7), entry(8), entry(9)]}, "an entry where none belongs"),
        ({"prompt_logprobs": [None, entry(9), entry(9)]}, "of token 9 where the token is 8"),
        ({"prompt_logprobs": [None, entry(8)]}, "2 prompt_logprobs entries for 3 tokens"),
    ],
)
def test_what_does_not_fit_is_named(change: dict[str, Any], named: str) -> None:
    problems = drawn_inconsistencies(answer(**{**GOOD_FIELDS, **change}), PROMPT, GOOD, VOCAB)
    assert any(named in problem for problem in problems), problems


def test_log_probabilities_sent_unasked_are_refused() -> None:
    plain = SamplingParams(n=2)
    fields = {"first_tokens": [5, 6], "logprobs": [entry(5), entry(6)]}
    assert drawn_inconsistencies(answer(**fields), PROMPT, plain, VOCAB) == [
        "logprobs sent, none asked for"
    ]


SPOILED = [
    {**entry(5), "logprob": 0.5},
    {**entry(5), "top_ids": [1]},
    {**entry(5), "rank": 0},
    {**entry(5), "logprob": float("nan")},
]


@pytest.mark.parametrize("spoiled", SPOILED)
def test_malformed_log_probabilities_do_not_parse(spoiled: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        answer(first_tokens=[5], logprobs=[spoiled])
