"""HTTP headers pdserve's processes exchange (router, workers, load generator)."""

from __future__ import annotations

# A client's request id, echoed back; the router sends one of its own per attempt.
REQUEST_ID_HEADER = "X-Request-Id"
# How a request was served: `colocated` or `disaggregated` (after any fallback).
MODE_HEADER = "X-Pdserve-Mode"
# The bucket of the routing table a request fell in, on the router's answers.
BUCKET_HEADER = "X-Pdserve-Bucket"
# The prefill worker a disaggregated request's decode worker hands its prompt to
# (honoured only with the pool's credential, and only for one of the pool's workers).
PREFILL_URL_HEADER = "X-Pdserve-Prefill-Url"
# With it, under KV-aware routing: the most prompt tokens the pool serves colocated.
# A decode worker whose prefix cache leaves at most that many of the prompt's tokens to
# compute computes them itself instead of handing the prompt off (the router's index
# may not have known what it holds when the router chose).
LOCAL_PREFILL_HEADER = "X-Pdserve-Local-Prefill-Tokens"
# On a decode worker's answer to a request that named a prefill worker and was served
# colocated (`X-Pdserve-Mode`): why. `cached`: its prefix cache held the prompt but
# those few tokens; `failed`: the hand-off failed and the failure policy prefilled here.
HANDOFF_HEADER = "X-Pdserve-Handoff"
# Prompt tokens the serving worker's engine found in its prefix cache (its own count,
# on a worker's answer to the router): what KV-aware routing predicted, as it was.
CACHED_TOKENS_HEADER = "X-Pdserve-Cached-Tokens"
# The prompt's token ids as the router computed them, sent in the body it forwards
# (`PROMPT_TOKEN_IDS_FIELD`), and the fingerprint of the tokenizer that computed them:
# a worker whose tokenizer has that fingerprint takes the ids instead of tokenizing the
# prompt again (honoured only with the pool's credential).
PROMPT_TOKENIZER_HEADER = "X-Pdserve-Prompt-Tokenizer"
PROMPT_TOKEN_IDS_FIELD = "pdserve_prompt_token_ids"


def header_count(value: str | None, most: int) -> int | None:
    """A header's whole number from 0 to `most`, if it is one: a peer's word, so ASCII
    digits only (no sign, space or other script's digits), and never more digits than
    `most` has (a long one is not converted at all); None otherwise."""
    if value is None or not (value.isascii() and value.isdigit()):
        return None
    if len(value) > len(str(most)):
        return None
    count = int(value)
    return count if count <= most else None
