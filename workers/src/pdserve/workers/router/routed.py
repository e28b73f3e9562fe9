"""A request as the router routes it: validated, with the path the routing table
chose for it. Made in the app, read by the forwarder and by the outcome that counts it
(below both, so neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.routing import Mode, Slo
from pdserve.workers.router.kv_scoring import KVPrompt
from pdserve.workers.router.revisions import RevisionSplit
from pdserve.workers.router.sse import TokenStream


@dataclass(slots=True)
class Routed:
    """A validated request and the path the routing table chose for it (not changed
    once made; not frozen, as a frozen dataclass costs a call per field to make and
    one is made for every request: by position, in the order of these fields)."""

    path: str  # /v1/completions or /v1/chat/completions
    body: bytes
    stream: bool
    prompt_tokens: int
    bucket: str
    mode: Mode
    request_id: str  # the router's own
    reply_id: str  # echoed to the client: its X-Request-Id, else the router's
    arrival: float
    slo: Slo
    choices: int = 1  # n
    echo_tokens: int = 0  # the prompt's tokens, when the answer echoes them
    generates: bool = True  # False: max_tokens 0, the prompt scored, nothing generated
    kv: KVPrompt | None = None  # its blocks, when the table routes KV-aware
    split: RevisionSplit | None = None  # its revision, when a rollout splits the traffic
    # The fingerprint of the tokenizer whose ids `body` carries (`prompt_ids`), if any.
    tokenizer: str | None = None

    def token_stream(self) -> TokenStream:
        """A watcher of this request's relayed stream."""
        return TokenStream(self.echo_tokens, self.generates)
