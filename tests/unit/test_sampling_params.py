"""Sampling parameters behave as the frozen dataclass they are declared as: every
field set by keyword or position with its declared default, immutable, equal and
hashed by value, copied with changes by `choice`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.sampling import SamplingParams


def test_the_constructor_takes_every_field_in_order_with_its_default() -> None:
    parameters = list(inspect.signature(SamplingParams).parameters.values())
    declared = dataclasses.fields(SamplingParams)
    assert [p.name for p in parameters] == [f.name for f in declared]
    assert [p.default for p in parameters] == [f.default for f in declared]
    assert vars(SamplingParams()) == {f.name: f.default for f in declared}


def test_every_field_is_set_from_its_argument() -> None:
    values = {f.name: (f.name, index) for index, f in enumerate(dataclasses.fields(SamplingParams))}
    by_name = SamplingParams(**values)  # type: ignore[arg-type]
    by_position = SamplingParams(*values.values())  # type: ignore[arg-type]
    for name, value in values.items():
        assert getattr(by_name, name) == value
        assert getattr(by_position, name) == value


def test_the_parameters_cannot_be_changed() -> None:
    params = SamplingParams(max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del params.seed
    assert params.max_tokens == 4


def test_equal_parameters_are_equal_and_hash_alike() -> None:
    one = SamplingParams(max_tokens=4, stop=("x",), seed=7)
    assert one == SamplingParams(max_tokens=4, stop=("x",), seed=7)
    assert hash(one) == hash(SamplingParams(max_tokens=4, stop=("x",), seed=7))
    assert one != SamplingParams(max_tokens=4, stop=("x",), seed=8)
    assert repr(one).startswith("SamplingParams(max_tokens=4, temperature=1.0,")


def test_a_choice_is_a_copy_with_its_own_seed() -> None:
    params = SamplingParams(max_tokens=4, n=3, seed=10, prompt_logprobs=2, logprobs=1)
    choice = params.choice(2)
    assert choice == dataclasses.replace(params, n=1, seed=12, prompt_logprobs=None)
    assert (choice.n, choice.seed, choice.prompt_logprobs, choice.logprobs) == (1, 12, None, 1)
    assert params.n == 3


def test_a_request_gives_each_field_its_own_value() -> None:
    body = {
        "prompt": "x", "max_tokens": 9, "temperature": 0.5, "top_p": 0.25, "top_k": 7,
        "seed": 11, "stop": ["a", "b"], "stop_token_ids": [3, 4], "ignore_eos": True,
        "min_tokens": 2, "n": 3, "logprobs": 5, "echo": True,
    }  # fmt: skip
    params = CompletionRequest.model_validate(body).sampling_params(default_max_tokens=None)
    assert params == SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.25, top_k=7, seed=11, stop=("a", "b"),
        stop_token_ids=(3, 4), ignore_eos=True, min_tokens=2, n=3, logprobs=5,
        prompt_logprobs=5,
    )  # fmt: skip
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "stop": "z", "top_k": -1,
         "logprobs": True, "top_logprobs": 2}
    )  # fmt: skip
    assert chat.sampling_params(default_max_tokens=12) == SamplingParams(
        max_tokens=12, stop=("z",), top_k=0, logprobs=2
    )
