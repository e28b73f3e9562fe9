"""The OpenAI-compatible request bodies a worker (and the router) accepts, and their
translation into engine sampling parameters. Each body is validated once, here, by its
model: a wrong type or value is a 400 naming the field. Unsupported features are
refused with a reason rather than silently ignored; unknown fields are ignored, as
OpenAI's and vLLM's servers do. Also the bodies of `/tokenize` and `/detokenize`, in
vLLM's shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.protocol.sampling import InvalidRequestError, SamplingParams

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
    n: int = Field(default=1, ge=1, le=_INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    return_token_ids: bool = False  # extension: each choice carries its token ids

    def check_supported(self) -> None:
        """Refuse features this server does not implement."""
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence_penalty and frequency_penalty are not supported")

    def logprobs_width(self) -> int | None:
        """Alternatives per sampled token's log-probability (None: none asked for)."""
        return None

    def prompt_logprobs_width(self) -> int | None:
        """Alternatives per prompt token's log-probability (None: none asked for)."""
        return None

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The engine's parameters for this request (validated)."""
        self.check_supported()
        # The fields read from the instance's dict: a model's attributes are read
        # through its __getattr__ hook, several times slower, and this runs for every
        # request.
        fields = self.__dict__
        stop = fields["stop"]
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        max_tokens, top_k = fields["max_tokens"], fields["top_k"]
        # By position, in the order SamplingParams declares its fields (a test holds
        # it): named, the call packs and unpacks a dict of them, 40% of the cost.
        params = SamplingParams(
            max_tokens if max_tokens is not None else default_max_tokens,  # max_tokens
            fields["temperature"],
            fields["top_p"],
            top_k if top_k > 0 else 0,  # top_k
            fields["seed"],
            stop,
            tuple(fields["stop_token_ids"]),
            fields["ignore_eos"],
            fields["min_tokens"],
            False,  # include_stop_str_in_output
            fields["n"],
            self.logprobs_width(),  # logprobs
            self.prompt_logprobs_width(),  # prompt_logprobs
        )
        params.validate()
        return params


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # The prompt returned before the completion; with logprobs, its tokens' too (the
    # first one's null). With max_tokens 0: scoring alone.
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=0, le=_INT64)  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=_INT64)

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
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens 0 samples nothing: it needs echo (to score the prompt)"
            )

    def logprobs_width(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_width(self) -> int | None:
        return self.logprobs if self.echo else None


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
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=_INT64)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def logprobs_width(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shapes): a `prompt`, or `messages` rendered by the chat
    template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    # Default: True for a prompt, False for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId]
