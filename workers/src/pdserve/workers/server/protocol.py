"""The OpenAI-compatible request bodies a worker (and the router) accepts, and their
translation into engine sampling parameters. Each body is validated once, here, by its
model: a wrong type or value is a 400 naming the field. Unsupported features are
refused with a reason rather than silently ignored; unknown fields are ignored, as
OpenAI's and vLLM's servers do."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.workers.engine.sampling import InvalidRequestError, SamplingParams

# JSON numbers beyond these bounds are no one's sampling parameter; refusing them in the
# model keeps absurd values out of the engine.
_INT64 = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT64)]


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries `usage`."""

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=_INT64)
    seed: int | None = Field(default=None, ge=0, le=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=_INT64)
    n: int = Field(default=1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None
    return_token_ids: bool = False  # extension: each choice carries its token ids

    def check_supported(self) -> None:
        """Refuse features this server does not implement."""
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence_penalty and frequency_penalty are not supported")
        if self.logprobs not in (None, False, 0):
            raise InvalidRequestError("logprobs are not supported")

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The engine's parameters for this request (validated)."""
        self.check_supported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else 0,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )
        params.validate()
        return params


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1, le=_INT64)  # OpenAI's default

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported")


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message's text (text parts of a multi-part content joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT64)

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)
