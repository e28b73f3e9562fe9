"""The OpenAI-compatible layer the router and the worker server share (request and answer
models, prompts, limits, served-model naming, tokenization, API errors, headers, the
internal credential, SSE token counting) and the routing.json schema the operator writes
and the router reads. Imports only `pdserve.base`."""
