"""The hand-off's HTTP bodies. The decode worker drives: it connects to a prefill
worker once (`/pd/connect`), then asks it to prefill a prompt into blocks it
reserved (`/pd/prefill`), and withdraws a hand-off it no longer wants
(`/pd/cancel`). Each side validates what the other sends: the prefill worker's
answers are parsed strictly (no coercion, no extra fields, finite numbers), and the
decode worker checks them against what it asked for (see decode.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.workers.engine.sampling import SamplingParams

PREFILL_URL_HEADER = "X-Pdserve-Prefill-Url"


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
    """The sampling parameters the prefill worker needs for the first token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool

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
        )

    def first_token_params(self) -> SamplingParams:
        """Parameters of a one-token request with the same sampling."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            min_tokens=min(self.min_tokens, 1),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
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


class PrefillAnswer(_Answer):
    """Prefill -> decode: the first token; the blocks hold the prompt's KV."""

    first_token: int = Field(ge=0)
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
