"""The OpenAI-compatible request bodies a worker accepts, and their translation into
engine sampling parameters. Unsupported features are refused with a reason rather
than silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.workers.engine.sampling import InvalidRequestError, SamplingParams


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries `usage`."""

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
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

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = 16  # OpenAI's default for completions

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


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (text parts of a multi-part content joined)."""
        if isinstance(self.content, list):
            parts = [part.get("text", "") for part in self.content if part.get("type") == "text"]
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)
