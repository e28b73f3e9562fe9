"""`/tokenize` and `/detokenize` in vLLM's shapes: a prompt (or a conversation, with
the chat template applied) to token ids as the completions endpoints see them, and
token ids back to text. Served by a worker and by the router alike."""

from __future__ import annotations

from aiohttp import web

from pdserve.protocol.api_errors import APIError, ClientRequest, read_body
from pdserve.protocol.models import ServedModel
from pdserve.protocol.prompts import chat_text, encode
from pdserve.protocol.requests import DetokenizeRequest, TokenizeRequest
from pdserve.protocol.response_models import DetokenizeAnswer, TokenizeAnswer
from pdserve.protocol.text import TextTokenizer


class TokenizationServing:
    """The tokenizer of a worker or the router, over HTTP, for the model it serves."""

    def __init__(self, tokenizer: TextTokenizer, model: ServedModel) -> None:
        self.tokenizer = tokenizer
        self.model = model

    async def tokenize(self, request: ClientRequest) -> web.Response:
        """POST /tokenize: to `{count, max_model_len, tokens, token_strs}`."""
        parsed = await read_body(request, TokenizeRequest)
        self.model.check(parsed.model)
        if parsed.messages is not None:
            text = chat_text(self.tokenizer, parsed.messages, parsed.add_generation_prompt)
            special = bool(parsed.add_special_tokens)
        else:
            text = parsed.prompt or ""
            special = parsed.add_special_tokens is not False
        tokens = await encode(self.tokenizer, text, special)
        strings = None
        if parsed.return_token_strs:
            strings = [self.tokenizer.token_string(token) or "" for token in tokens]
        answer = TokenizeAnswer(
            count=len(tokens),
            max_model_len=self.model.max_model_len,
            tokens=tokens,
            token_strs=strings,
        )
        return web.json_response(answer.model_dump())

    async def detokenize(self, request: ClientRequest) -> web.Response:
        """POST /detokenize: `tokens` to `{prompt}`."""
        parsed = await read_body(request, DetokenizeRequest)
        self.model.check(parsed.model)
        vocab = self.tokenizer.vocab_size
        if any(token >= vocab for token in parsed.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {vocab})")
        answer = DetokenizeAnswer(prompt=self.tokenizer.decode(parsed.tokens))
        return web.json_response(answer.model_dump())
