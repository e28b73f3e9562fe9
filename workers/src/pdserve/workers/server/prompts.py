"""A request's prompt as token ids: the prompt of a completion (text or ids), or a
conversation rendered with the model's chat template. The worker and the router
tokenize the same way, so the router's length bucket is the worker's prompt length."""

from __future__ import annotations

import asyncio

from pdserve.workers.api_errors import APIError
from pdserve.workers.engine.tokenizer import Tokenizer
from pdserve.workers.server.protocol import ChatCompletionRequest, CompletionRequest

# Text longer than this is tokenized on a thread, so the event loop stays free.
_TOKENIZE_INLINE_CHARS = 16 * 1024


async def completion_prompt(tokenizer: Tokenizer, parsed: CompletionRequest) -> list[int]:
    """The token ids of a completion's prompt."""
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return await _encode(tokenizer, prompt, add_special_tokens=True)
    return [int(token) for token in prompt]  # type: ignore[arg-type]


async def chat_prompt(tokenizer: Tokenizer, parsed: ChatCompletionRequest) -> list[int]:
    """The token ids of a conversation with the chat template applied."""
    messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as error:  # a template may raise on unusual conversations
        raise APIError(400, f"messages do not fit the chat template: {error}") from error
    return await _encode(tokenizer, text, add_special_tokens=False)


async def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
    return tokenizer.encode(text, add_special_tokens)
