"""The prompt's token ids the router computed, passed on to the decode worker so that
it does not tokenize the prompt again (about a microsecond per token, on the path to
the first token).

The router adds them to the client's body as one more field (`PROMPT_TOKEN_IDS_FIELD`,
last, so it is the one a JSON parser keeps should the client have sent one of that
name) and names its tokenizer's fingerprint in `PROMPT_TOKENIZER_HEADER`. A worker
takes the ids only from a caller with the pool's credential and only when its own
tokenizer has that fingerprint; otherwise it tokenizes the prompt itself, as before.
The rest of the body is the client's, byte for byte (its text, for echo).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from pdserve.protocol.headers import PROMPT_TOKEN_IDS_FIELD

_FIELD = b'"' + PROMPT_TOKEN_IDS_FIELD.encode() + b'":'


def with_prompt_ids(body: bytes, token_ids: Sequence[int]) -> bytes | None:
    """`body` (a JSON object, already parsed as one) with the prompt's ids as its last
    field; None when it does not end as an object does."""
    end = body.rfind(b"}")
    if end < 0 or body[end + 1 :].strip():
        return None
    head = body[:end].rstrip()
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + _FIELD + orjson.dumps(list(token_ids)) + b"}"
