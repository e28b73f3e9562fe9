"""A request's prompt as token ids: the prompt of a completion (text or ids), or a
conversation rendered with the model's chat template. The worker and the router
tokenize the same way, so the router's length bucket is the worker's prompt length."""

from __future__ import annotations

import asyncio

from pdserve.protocol.api_errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.protocol.text import TextTokenizer

# Text longer than this is tokenized on a thread, so the event loop stays free; so is
# shorter text whose tokenizer says its ids need more than lookups (a prompt of new
# words: tens to hundreds of milliseconds in which the loop would relay no answer and
# route no other request).
_TOKENIZE_INLINE_CHARS = 16 * 1024


async def completion_prompt(tokenizer: TextTokenizer, parsed: CompletionRequest) -> list[int]:
    """The token ids of a completion's prompt."""
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return await encode(tokenizer, prompt, add_special_tokens=True)
    return [int(token) for token in prompt]  # type: ignore[arg-type]


async def chat_prompt(tokenizer: TextTokenizer, parsed: ChatCompletionRequest) -> list[int]:
    """The token ids of a conversation with the chat template applied."""
    text = chat_text(tokenizer, parsed.messages, add_generation_prompt=True)
    return await encode(tokenizer, text, add_special_tokens=False)


def chat_text(
    tokenizer: TextTokenizer, messages: list[ChatMessage], add_generation_prompt: bool
) -> str:
    """A conversation rendered by the model's chat template; a 400 if it does not fit."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # a template may raise on unusual conversations
        raise APIError(400, f"messages do not fit the chat template: {error}") from error


async def encode(tokenizer: TextTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` (on a thread when it is long or costly)."""
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        ids = tokenizer.encode_inline(text, add_special_tokens)
        if ids is not None:
            return ids
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
