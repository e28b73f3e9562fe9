"""The hand-off's HTTP bodies. The decode worker drives: it connects to a prefill
worker once (`/pd/connect`), then asks it to prefill a prompt into blocks it
reserved (`/pd/prefill`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.workers.engine.sampling import SamplingParams

PREFILL_URL_HEADER = "X-Pdserve-Prefill-Url"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConnectRequest(_Body):
    """Decode -> prefill: meet, over the pair id the decode worker chose."""

    peer: str = Field(min_length=1, max_length=128)
    metadata: dict[str, Any]


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


class PrefillAnswer(_Body):
    """Prefill -> decode: the first token; the blocks hold the prompt's KV."""

    first_token: int
    bytes: int
    transfer_seconds: float
    descriptors: int
    prefill_seconds: float
