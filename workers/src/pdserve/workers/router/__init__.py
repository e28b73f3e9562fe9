"""The router: a pool's OpenAI-compatible front door. It routes each request by its
prompt's length bucket, colocated or disaggregated, to the least loaded workers it
discovered (a static list, or Kubernetes EndpointSlices), retries before the first
token, and keeps a circuit breaker per worker. It loads no torch."""

from pdserve.workers.compiled import search_compiled

search_compiled(__name__, __path__)
