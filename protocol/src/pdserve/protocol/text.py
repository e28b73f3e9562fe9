"""What the OpenAI layer needs of a tokenizer (the model's, loaded by the workers): text to
token ids and back, and the chat template. A protocol, so this layer loads no model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TextTokenizer(Protocol):
    """The tokenizer calls that prompts and the tokenization endpoints make."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        ...

    def encode_inline(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """`encode`'s ids where they come cheaply; None where computing them is
        better done on a thread."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        ...

    def token_string(self, token_id: int) -> str | None:
        """A token's own form in the vocabulary, None for an unknown id."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """`messages` rendered with the model's chat template."""
        ...
