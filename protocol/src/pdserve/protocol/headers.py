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
# Prompt tokens the serving worker's engine found in its prefix cache (its own count,
# on a worker's answer to the router): what KV-aware routing predicted, as it was.
CACHED_TOKENS_HEADER = "X-Pdserve-Cached-Tokens"
# The prompt's token ids as the router computed them, sent in the body it forwards
# (`PROMPT_TOKEN_IDS_FIELD`), and the fingerprint of the tokenizer that computed them:
# a worker whose tokenizer has that fingerprint takes the ids instead of tokenizing the
# prompt again (honoured only with the pool's credential).
PROMPT_TOKENIZER_HEADER = "X-Pdserve-Prompt-Tokenizer"
PROMPT_TOKEN_IDS_FIELD = "pdserve_prompt_token_ids"
