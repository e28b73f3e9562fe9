"""The hand-off's HTTP bodies. The decode worker drives: it connects to a prefill
worker once (`/pd/connect`), then asks it to prefill a prompt into blocks it
reserved (`/pd/prefill`), and withdraws a hand-off it no longer wants
(`/pd/cancel`). Each side validates what the other sends: the prefill worker's
answers are parsed strictly (no coercion, no extra fields, finite numbers), and the
decode worker checks them against what it asked for (see decode.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.workers.engine.sampler import Sampled


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConnectRequest(_Body):
    """Decode -> prefill: meet, over the pair id the decode worker chose; `replaces`
    names the pair it met this prefill worker under before and has dropped since
    (a broken connection), which the prefill worker drops too."""

    peer: str = Field(min_length=1, max_length=128)
    metadata: dict[str, Any]
    replaces: str | None = Field(default=None, min_length=1, max_length=128)


class ConnectAnswer(_Body):
    """Prefill -> decode: its own agent's metadata."""

    metadata: dict[str, Any]


class WireSampling(_Body):
    """The sampling parameters the prefill worker needs for the first token (one per
    choice for n > 1), and the log-probabilities to send back with it."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    n: int = Field(default=1, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    sample: bool = True  # False: the prompt's log-probabilities only (max_tokens 0)

    @classmethod
    def of(cls, params: SamplingParams) -> WireSampling:
        """From the request's parameters."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            n=params.n,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
            sample=params.max_tokens != 0,
        )

    def first_token_params(self) -> SamplingParams:
        """Parameters of a one-token request with the same sampling (no token when
        nothing is to be sampled)."""
        return SamplingParams(
            max_tokens=1 if self.sample else 0,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            min_tokens=min(self.min_tokens, 1),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


class PrefillRequest(_Body):
    """Decode -> prefill: compute this prompt and write its KV into these blocks."""

    peer: str = Field(min_length=1, max_length=128)
    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: WireSampling
    block_ids: list[int]  # the decode worker's blocks, in prompt order
    first_block: int = Field(ge=0)  # index among the prompt's blocks of block_ids[0]
    lease_ms: int = Field(gt=0)  # how long the decode worker holds the blocks


class _Answer(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# Log-probabilities of -inf (tokens a processed distribution cuts off) travel as this.
LOGPROB_FLOOR = -9999.0


TokenId = Annotated[int, Field(ge=0)]
Logprob = Annotated[float, Field(ge=LOGPROB_FLOOR, le=0.0)]


class WireLogprob(_Answer):
    """A token's log-probability and the most likely alternatives (a TokenLogprob):
    `top_ids[i]` has `top_logprobs[i]`."""

    token_id: TokenId
    logprob: Logprob
    rank: int = Field(ge=1)
    top_ids: list[TokenId]
    top_logprobs: list[Logprob]

    @model_validator(mode="after")
    def _pairs(self) -> WireLogprob:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("top_ids and top_logprobs differ in length")
        return self

    @classmethod
    def of(cls, entry: TokenLogprob) -> WireLogprob:
        """From the engine's entry."""
        return cls(
            token_id=entry.token_id,
            logprob=max(entry.logprob, LOGPROB_FLOOR),
            rank=entry.rank,
            top_ids=[token for token, _ in entry.top],
            top_logprobs=[max(value, LOGPROB_FLOOR) for _, value in entry.top],
        )

    def entry(self) -> TokenLogprob:
        """As the engine's entry."""
        top = tuple(zip(self.top_ids, self.top_logprobs, strict=True))
        return TokenLogprob(self.token_id, self.logprob, self.rank, top)


def wire_prompt_logprobs(entries: PromptLogprobs | None) -> list[WireLogprob | None] | None:
    """A prompt's log-probabilities for the wire (the first None)."""
    if entries is None:
        return None
    return [None if entry is None else WireLogprob.of(entry) for entry in entries]


class PrefillAnswer(_Answer):
    """Prefill -> decode: the first token of each choice (none when nothing was to be
    sampled), with the log-probabilities asked for; the blocks hold the prompt's KV."""

    first_tokens: list[TokenId]
    logprobs: list[WireLogprob] | None = None
    prompt_logprobs: list[WireLogprob | None] | None = None

    def drawn(self) -> tuple[Sampled, PromptLogprobs | None]:
        """What the prefill worker drew, and the prompt's log-probabilities, as the
        engine takes them."""
        logprobs = None if self.logprobs is None else [e.entry() for e in self.logprobs]
        prompt = None
        if self.prompt_logprobs is not None:
            prompt = tuple(None if e is None else e.entry() for e in self.prompt_logprobs)
        return Sampled(list(self.first_tokens), logprobs), prompt

    blocks: int = Field(ge=0)  # blocks written, all those the decode worker named
    bytes: int = Field(ge=0)
    transfer_seconds: float = Field(ge=0)
    descriptors: int = Field(ge=0)
    prefill_seconds: float = Field(ge=0)


class CancelRequest(_Body):
    """Decode -> prefill: the decode worker no longer wants this hand-off (its
    client left, or its lease ran out). The block ids let the prefill worker complete
    receives the decode worker posted for it, if it had not started writing."""

    peer: str = Field(min_length=1, max_length=128)
    request_id: str = Field(min_length=1, max_length=256)
    block_ids: list[int]


class CancelAnswer(_Answer):
    """Prefill -> decode: whether the hand-off's write has stopped for good (nothing
    more of it lands in the decode worker's blocks)."""

    stopped: bool
