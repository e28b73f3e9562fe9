"""The settings of `pdserve worker`, each declared once: the dataclass field is the
flag, its default and its help (see `pdserve.base.options`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.base.options import (
    OptionError,
    non_negative_float,
    option,
    parse_bytes,
    port_number,
    positive_float,
    positive_int,
)
from pdserve.protocol.limits import LIMITS

ROLES = ("both", "prefill", "decode")
# As in pdserve.workers.engine.config; not imported, so `pdserve --help` loads no torch.
BUDGET_MODES = ("static", "adaptive")
PREFILL_ORDERS = ("shortest", "arrival")
DEFAULT_MIN_BUDGET = 32
# The same default as the ServingPool's `spec.kvTransfer.backend`.
DEFAULT_KV_TRANSFER = "nixl"
KV_TRANSFER_BACKENDS = ("nixl", "torch")
# As in pdserve.workers.engine.logprobs (vLLM's names).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

_ENGINE = "engine"
_BUDGET = "token budget"
_KV = "KV cache"
_HANDOFF = "P/D hand-off (roles prefill and decode)"


@dataclass(frozen=True)
class WorkerOptions:
    """The settings of `pdserve worker` (with `RequestLimits`, shared with the router)."""

    model: Path = option(parse=Path, help="Hugging Face model directory")
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, parse=port_number, help="port to listen on (0: any free port)")
    port_file: Path | None = option(
        None, parse=Path, metavar="PATH",
        help="once listening, write the port here (for --port 0)",
    )  # fmt: skip
    role: str = option(
        "both", choices=ROLES,
        help="both: serve requests alone; decode: also take prompts prefilled by a prefill "
        "worker; prefill: only prefill for decode workers",
    )  # fmt: skip
    pool: str = option("local", help="pool name for metric labels")
    revision: str = option(
        "", metavar="NAME",
        help="the revision of its role this worker runs (a rollout's canary or stable one): "
        "published at /load for the router's split and as the metrics' revision label",
    )  # fmt: skip
    served_model_name: str | None = option(
        None, help="model id in the API (default: the model directory's name)"
    )
    max_num_batched_tokens: int = option(
        512, parse=positive_int, group=_ENGINE,
        help="token budget of one engine step: decodes first, prefill chunks fill the rest; "
        "smaller gives smoother inter-token latency and a slower first token",
    )  # fmt: skip
    max_num_seqs: int = option(
        64, parse=positive_int, group=_ENGINE, help="most requests in the running batch"
    )
    no_chunked_prefill: bool = option(
        False, group=_ENGINE, help="prefill each prompt in one step (a baseline; ITL suffers)"
    )
    prefill_order: str = option(
        "shortest", choices=PREFILL_ORDERS, group=_ENGINE,
        help="the order prompts take a step's budget after the decodes: shortest, the "
        "fewest tokens left to compute first (a prefix-cache hit or a short prompt does "
        "not wait behind a long prompt's chunks); arrival, first come first served",
    )  # fmt: skip
    max_prefill_overtakes: int = option(
        32, parse=positive_int, metavar="STEPS", group=_ENGINE,
        help="shortest: steps in which prompts that arrived later may be served before a "
        "prompt; then it goes first (its wait is bounded)",
    )  # fmt: skip
    token_budget: str = option(
        "static", choices=BUDGET_MODES, group=_BUDGET,
        help="static: every step may compute --max-num-batched-tokens tokens; adaptive: "
        "each step gets the most prefill tokens whose predicted time keeps the running "
        "streams' inter-token latency under --target-itl-ms",
    )  # fmt: skip
    target_itl_ms: float | None = option(
        None, parse=positive_float, metavar="MS", group=_BUDGET,
        help="inter-token latency target (adaptive: what the budget keeps; static: only "
        "counts the steps over it)",
    )  # fmt: skip
    min_budget: int = option(
        DEFAULT_MIN_BUDGET, parse=positive_int, metavar="N", group=_BUDGET,
        help="adaptive: prefill tokens a step gives while a prompt waits when the decodes "
        "alone already miss the target (a step they keep under it never goes over it for "
        "the floor)",
    )  # fmt: skip
    max_budget: int | None = option(
        None, parse=positive_int, metavar="N", group=_BUDGET,
        help="adaptive: most tokens in a step (default: --max-num-batched-tokens)",
    )  # fmt: skip
    max_model_len: int | None = option(
        None, parse=positive_int, group=_ENGINE,
        help="longest prompt plus output, in tokens (default: the model's context)",
    )  # fmt: skip
    dtype: str | None = option(
        None, choices=("float32", "float16", "bfloat16"), group=_ENGINE,
        help="weights' dtype (default: the checkpoint's, float32 on CPU for half types)",
    )  # fmt: skip
    device: str = option("cpu", group=_ENGINE, help="cpu, cuda or cuda:N")
    seed: int = option(0, group=_ENGINE, help="seed of requests that give none")
    logprobs_mode: str = option(
        "raw_logprobs", choices=LOGPROBS_MODES, group=_ENGINE,
        help="log-probabilities requests get: raw_logprobs, the model's own distribution; "
        "processed_logprobs, the one tokens are drawn from (after temperature, top-k, top-p "
        "and min_tokens)",
    )  # fmt: skip
    threads: int | None = option(
        None, parse=positive_int, group=_ENGINE, help="torch CPU threads (default on CPU: 1)"
    )
    num_kv_blocks: int | None = option(
        None, parse=positive_int, group=_KV, exclusive="kv-size",
        help="KV cache size in blocks (default: from --kv-cache-memory or the device)",
    )  # fmt: skip
    kv_cache_memory: int | None = option(
        None, parse=parse_bytes, metavar="BYTES", group=_KV, exclusive="kv-size",
        help="KV cache size in bytes, e.g. 512MiB or 2GB",
    )  # fmt: skip
    block_size: int = option(16, parse=positive_int, group=_KV, help="tokens per KV block")
    no_prefix_caching: bool = option(
        False, group=_KV, help="do not share KV blocks between requests with a common prefix"
    )
    prefix_caching_hash_seed: str = option(
        "", group=_KV, metavar="SEED",
        help="seed of the prefix-cache block hashes (the pool's routers must use the same; "
        "default none)",
    )  # fmt: skip
    kv_cache_dtype: str = option(
        "auto", choices=("auto", "float32", "float16", "bfloat16"), group=_KV,
        help="KV cache dtype (auto: the weights' dtype)",
    )  # fmt: skip
    kv_transfer: str = option(
        DEFAULT_KV_TRANSFER, choices=KV_TRANSFER_BACKENDS, group=_HANDOFF,
        help="KV transfer backend: nixl (UCX) or torch (gloo on CPU, NCCL on GPU)",
    )  # fmt: skip
    transfer_failure_policy: str = option(
        "recompute", choices=("recompute", "fail"), group=_HANDOFF,
        help="decode: on a failed hand-off, prefill here (recompute) or end the request",
    )  # fmt: skip
    handoff_timeout: float = option(
        30.0, parse=positive_float, metavar="SECONDS", group=_HANDOFF,
        help="decode: lease on the KV blocks reserved for a hand-off (a hand-off not done "
        "by then fails); prefill: the most a hand-off's prefill and write may take",
    )  # fmt: skip
    handoff_room_wait: float = option(
        10.0, parse=non_negative_float, metavar="SECONDS", group=_HANDOFF,
        help="decode: how long a hand-off waits for requests here to free the KV blocks its "
        "prompt needs when too few are free (0: not at all) before the failure policy "
        "applies",
    )  # fmt: skip
    kv_transfer_host: str | None = option(
        None, group=_HANDOFF,
        help="address peers reach this worker's transfer agent at (default: --host)",
    )  # fmt: skip
    internal_token_file: Path | None = option(
        None, parse=Path, metavar="PATH", group=_HANDOFF,
        help="file holding the pool's internal credential: the hand-off header and /pd/* "
        "are honoured only for callers presenting it (without it, never)",
    )  # fmt: skip
    allow_direct_clients: bool = option(
        False,
        help="serve the OpenAI and tokenizer endpoints to callers without the pool's "
        "credential too (by default a worker given --internal-token-file serves them to "
        "its router only, so the router's API keys and limits cannot be bypassed)",
    )  # fmt: skip
    prefill_peer: tuple[str, ...] = option(
        repeat=True, metavar="URL", group=_HANDOFF,
        help="decode: a prefill worker hand-offs may name, http://HOST:PORT; a HOST that "
        "is a DNS name (a headless Service) stands for every address it resolves to "
        "(repeatable)",
    )  # fmt: skip
    prefill_peers_file: Path | None = option(
        None, parse=Path, metavar="PATH", group=_HANDOFF,
        help="decode: a file listing more such URLs, one per line, read when a hand-off "
        "names a worker not known yet",
    )  # fmt: skip
    max_queued_requests: int = option(
        1024, parse=positive_int, group=LIMITS,
        help="requests waiting for their first engine step; past this, new ones get 429",
    )  # fmt: skip
    queue_timeout: float = option(
        60.0, parse=positive_float, metavar="SECONDS", group=LIMITS,
        help="a request still waiting for its first engine step after this long gets 503",
    )  # fmt: skip
    max_stream_buffer_tokens: int = option(
        2048, parse=positive_int, metavar="N", group=LIMITS,
        help="generated tokens a request may hold for a client that does not read them "
        "(with 20 logprobs each, about 2.7 KB a token); past this the request is aborted "
        "and its KV cache freed",
    )  # fmt: skip
    drain_timeout: float = option(
        30.0, parse=non_negative_float, metavar="SECONDS",
        help="once told to stop (SIGTERM), refuse new requests (503) and let those in flight "
        "and their KV hand-offs finish for at most this long",
    )  # fmt: skip
    log_level: str = option("info", choices=("debug", "info", "warning", "error"), help="log level")

    def __post_init__(self) -> None:
        for problem in self._budget_problems():
            raise OptionError(problem)

    def _budget_problems(self) -> list[str]:
        """What is wrong with the token budget flags taken together."""
        problems = []
        if self.max_budget is not None and self.min_budget > self.max_budget:
            problems.append(
                f"--min-budget ({self.min_budget}) must not exceed --max-budget ({self.max_budget})"
            )
        if self.token_budget != "adaptive":
            return problems
        if self.max_budget is None and self.min_budget > self.max_num_batched_tokens:
            problems.append(
                f"--min-budget ({self.min_budget}) must not exceed the ceiling, "
                f"--max-budget (default: --max-num-batched-tokens, {self.max_num_batched_tokens})"
            )
        if self.target_itl_ms is None:
            problems.append("--token-budget adaptive needs --target-itl-ms")
        if self.no_chunked_prefill:
            problems.append(
                "--token-budget adaptive needs chunked prefill (drop --no-chunked-prefill)"
            )
        return problems
