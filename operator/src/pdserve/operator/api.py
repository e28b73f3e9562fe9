"""The `ServingPool` API (group pdserve.dev, version v1alpha1).

Over 600 lines on purpose: it is one schema (one CRD), read top to bottom as the
manifest is; its cross-field rules (CEL and pydantic, side by side) refer to fields of
several parts of the spec, and the whole module is what `crd` generates from.

These pydantic models are the single source of truth: the CRD
(charts/pdserve/crds/servingpool.yaml) is generated from them (`pdserve crd`), and
every cross-field rule is written twice, as a CEL rule the API server runs and as a
pydantic check, with one message, so a pool refused by the cluster is refused in the
same words by `pdserve local`.

Python uses snake_case; manifests use camelCase (the alias of every field).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, NamedTuple

from kubernetes.utils import parse_quantity
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

GROUP = "pdserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ServingPool"
PLURAL = "servingpools"
SINGULAR = "servingpool"
SHORT_NAMES = ("sp",)

# The longest name derived from a pool is "<pool>-prefill" (a Service name: a
# DNS-1035 label of at most 63 characters); 50 leaves room for later suffixes.
MAX_POOL_NAME = 50
GPU_RESOURCE = "nvidia.com/gpu"

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
WorkerRole = Literal["prefill", "decode", "both"]
Dtype = Literal["float32", "float16", "bfloat16"]
KvCacheDtype = Literal["auto", "float32", "float16", "bfloat16"]
TransferBackend = Literal["nixl", "torch"]
FailurePolicy = Literal["recompute", "fail"]
BudgetMode = Literal["static", "adaptive"]
RoutingMode = Literal["colocated", "disaggregated"]
RoutingPolicy = Literal["kv-aware", "load"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
ConditionType = Literal["Ready", "Progressing", "Degraded", "ScalingActive", "DisaggregationActive"]
Scaler = Literal["planner", "hpa", "keda"]
ConditionStatus = Literal["True", "False", "Unknown"]

# Kubernetes' resource.Quantity, without a sign (no resource is negative).
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and (len(value) > 64 or not re.fullmatch(QUANTITY_PATTERN, value)):
        raise PydanticCustomError(
            "quantity",
            "'{value}' should match a Kubernetes quantity such as 4Gi or 500m",
            {"value": value},
        )
    return value


def quantity_value(quantity: int | str) -> Decimal:
    """The number a Kubernetes quantity stands for ("4Gi" -> 4294967296)."""
    value: Decimal = parse_quantity(quantity)  # type: ignore[no-untyped-call]
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

# Bounded strings and maps keep the API server's CEL cost estimate low.
ShortStr = Annotated[str, StringConstraints(min_length=1, max_length=253)]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
LabelMap = Annotated[dict[ShortStr, LabelValue], Field(max_length=32)]
QuantityMap = Annotated[dict[ShortStr, Quantity], Field(max_length=16)]
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label


class Rule(NamedTuple):
    """A cross-field rule: a CEL expression for the API server and its message.

    The pydantic validators raise the same message, so both sides read alike.
    """

    expr: str
    message: str
    field_path: str | None = None

    def schema(self) -> dict[str, str]:
        """The rule as one entry of `x-kubernetes-validations`."""
        entry = {"rule": self.expr, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        return entry


def cel(*rules: Rule) -> dict[str, Any]:
    """JSON-schema extras attaching CEL rules to a model or field."""
    return {"x-kubernetes-validations": [rule.schema() for rule in rules]}


def refuse(rule: Rule) -> PydanticCustomError:
    """The pydantic error for a broken rule (no "Value error," prefix)."""
    return PydanticCustomError("servingpool_rule", rule.message)


NAME_RULE = Rule(
    f"size(self.metadata.name) <= {MAX_POOL_NAME} && self.metadata.name.matches('{DNS_LABEL}')",
    f"metadata.name must start with a lowercase letter, hold only lowercase letters, "
    f"digits and '-', and be at most {MAX_POOL_NAME} characters (it prefixes Service names)",
)
DISAGGREGATED_NEEDS_PREFILL = Rule(
    "!has(self.routing) || !has(self.routing.buckets)"
    " || !self.routing.buckets.exists(b, b.mode == 'disaggregated') || has(self.prefill)",
    "a disaggregated bucket in routing.buckets needs a prefill pool: set spec.prefill",
    ".routing.buckets",
)
AUTOSCALING_NEEDS_SLO = Rule(
    "!has(self.autoscaling) || !has(self.autoscaling.enabled) || !self.autoscaling.enabled"
    " || has(self.slo)",
    "autoscaling.enabled needs latency targets: set spec.slo",
    ".autoscaling.enabled",
)
ONLY_LAST_BUCKET_UNBOUNDED = Rule(
    "self.all(b, has(b.maxInputTokens)) || (!has(self[size(self) - 1].maxInputTokens)"
    " && size(self.filter(b, !has(b.maxInputTokens))) == 1)",
    "only the last bucket may omit maxInputTokens",
)
BUCKETS_ASCENDING = Rule(
    "self.map(b, has(b.maxInputTokens), b.maxInputTokens).isSorted()"
    " && self.all(b, !has(b.maxInputTokens) || self.exists_one(c,"
    " has(c.maxInputTokens) && c.maxInputTokens == b.maxInputTokens))",
    "maxInputTokens must be strictly ascending",
)
KV_SIZE_ONCE = Rule(
    "!(has(self.numKvBlocks) && has(self.kvCacheMemory))",
    "set numKvBlocks or kvCacheMemory, not both",
)
BATCH_HOLDS_SEQS = Rule(
    "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs)"
    " || self.maxNumBatchedTokens >= self.maxNumSeqs",
    "maxNumBatchedTokens must be at least maxNumSeqs (each running sequence needs "
    "a token every step)",
    ".maxNumBatchedTokens",
)
BUDGET_FLOOR_UNDER_CEILING = Rule(
    "!has(self.tokenBudget) || (has(self.tokenBudget.max)"
    " ? self.tokenBudget.min <= self.tokenBudget.max"
    " : self.tokenBudget.mode != 'adaptive' || self.tokenBudget.min <= self.maxNumBatchedTokens)",
    "tokenBudget.min must not exceed tokenBudget.max (default: maxNumBatchedTokens)",
    ".tokenBudget.min",
)


def _adaptive_needs_target(role: Role) -> Rule:
    """A role's adaptive token budget needs a target: its own, or the pool's ITL SLO."""
    budget = f"self.{role}.engine.tokenBudget"
    return Rule(
        f"!has(self.{role}) || !has(self.{role}.engine) || !has({budget})"
        f" || {budget}.mode != 'adaptive' || has({budget}.targetItlMs)"
        " || (has(self.slo) && has(self.slo.itl))",
        f"{role}.engine.tokenBudget: mode adaptive needs targetItlMs, or an ITL target in "
        "spec.slo.itl",
        f".{role}.engine.tokenBudget",
    )


PREFILL_BUDGET_NEEDS_TARGET = _adaptive_needs_target("prefill")
DECODE_BUDGET_NEEDS_TARGET = _adaptive_needs_target("decode")
BUDGET_NEEDS_TARGET: dict[Role, Rule] = {
    "prefill": PREFILL_BUDGET_NEEDS_TARGET,
    "decode": DECODE_BUDGET_NEEDS_TARGET,
}
GPUS_BY_FIELD = Rule(
    "!has(self.resources)"
    f" || ((!has(self.resources.limits) || !('{GPU_RESOURCE}' in self.resources.limits))"
    f" && (!has(self.resources.requests) || !('{GPU_RESOURCE}' in self.resources.requests)))",
    f"request GPUs with gpus, not with {GPU_RESOURCE} in resources",
    ".resources",
)
MIN_NOT_ABOVE_MAX = Rule(
    "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
    "minReplicas must not exceed maxReplicas",
    ".minReplicas",
)
ENV_VALUE_ONCE = Rule(
    "!(has(self.value) && has(self.valueFrom))",
    "set value or valueFrom, not both",
)
ENV_SOURCE_ONE = Rule(
    "has(self.secretKeyRef) != has(self.configMapKeyRef)",
    "valueFrom needs exactly one of secretKeyRef or configMapKeyRef",
)
HPA_NEEDS_ONE_REPLICA = Rule(
    "!has(self.policy) || !has(self.policy.type) || self.policy.type != 'hpa'"
    " || ((!has(self.prefill) || !has(self.prefill.minReplicas) || self.prefill.minReplicas >= 1)"
    " && (!has(self.decode) || !has(self.decode.minReplicas) || self.decode.minReplicas >= 1))",
    "policy type hpa needs minReplicas of at least 1 (a HorizontalPodAutoscaler does "
    "not scale to zero)",
    ".policy.type",
)
RATIO_MIN_NOT_ABOVE_MAX = Rule(
    "!has(self.min) || !has(self.max) || self.min <= self.max",
    "min must not exceed max",
    ".min",
)
RATIO_WITHIN_REPLICAS = Rule(
    "!has(self.policy) || !has(self.policy.prefillDecodeRatio)"
    " || ((!has(self.policy.prefillDecodeRatio.min)"
    " || self.policy.prefillDecodeRatio.min * double(self.decode.minReplicas)"
    " <= double(self.prefill.maxReplicas))"
    " && (!has(self.policy.prefillDecodeRatio.max)"
    " || self.policy.prefillDecodeRatio.max * double(self.decode.maxReplicas)"
    " >= double(self.prefill.minReplicas)))",
    "prefillDecodeRatio admits no split within the replica bounds: min must not exceed "
    "prefill.maxReplicas / decode.minReplicas, and max must be at least "
    "prefill.minReplicas / decode.maxReplicas",
    ".policy.prefillDecodeRatio",
)
EXISTS_TAKES_NO_VALUE = Rule(
    "!has(self.operator) || self.operator != 'Exists' || !has(self.value)",
    "a toleration with operator Exists takes no value",
)


CANARY_NEEDS_STEPS = Rule(
    "!has(self.type) || self.type != 'canary' || (has(self.steps) && size(self.steps) > 0)",
    "a canary strategy needs at least one step",
    ".steps",
)
STEPS_ASCENDING = Rule(
    "self.map(s, s.weight).isSorted() && self.all(s, self.exists_one(t, t.weight == s.weight))",
    "steps: each step's weight must be above the one before (the canary only grows until "
    "it completes)",
)


class ApiModel(BaseModel):
    """Base of every API object: immutable, camelCase in manifests, strict keys."""

    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid"
    )


# --- spec ----------------------------------------------------------------------------


class ModelSpec(ApiModel):
    """The model every worker of the pool serves (shared by prefill and decode)."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")] = Field(
        max_length=256, description="Model name that clients send in requests."
    )
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Checkpoint directory inside the container, or a URI the worker can "
        "fetch (hf://org/name).",
    )
    dtype: Dtype = Field(default="bfloat16", description="Weight and activation dtype.")
    max_model_len: int | None = Field(
        default=None, ge=1, le=1 << 22, description="Context length (default: the checkpoint's)."
    )
    claim_name: ShortStr | None = Field(
        default=None, description="PersistentVolumeClaim holding the model, mounted read-only."
    )
    mount_path: str = Field(
        default="/models", min_length=1, max_length=1024, description="Where claimName is mounted."
    )


class KvCacheSpec(ApiModel):
    """KV cache layout; prefill and decode must agree on it to exchange blocks."""

    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV cache block.")
    dtype: KvCacheDtype = Field(default="auto", description="KV cache dtype (auto: the model's).")
    hash_seed: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Seed of the prefix-cache block hashes, given to every worker and the "
        "router (unset: none). A worker whose seed differs is refused for KV-aware "
        "routing; changing it starts every cache afresh.",
    )


class TokenBudgetSpec(ApiModel):
    """How each engine step's token budget is chosen."""

    mode: BudgetMode = Field(
        default="static",
        description="static: every step may compute maxNumBatchedTokens tokens; adaptive: "
        "each step gets the most prefill tokens whose predicted time keeps the running "
        "streams' inter-token latency under targetItlMs.",
    )
    target_itl_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description="Inter-token latency target in milliseconds (default: spec.slo.itl). "
        "In static mode it only counts the steps over it.",
    )
    min_budget: int = Field(
        default=32,
        ge=1,
        le=1 << 20,
        alias="min",
        description="Adaptive: prefill tokens a step gives while a prompt waits when the "
        "decodes alone already miss the target (prompts progress however many decodes "
        "run); a step the decodes keep under the target never goes over it for the floor.",
    )
    max_budget: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        alias="max",
        description="Adaptive: most tokens in a step (default: maxNumBatchedTokens).",
    )


class EngineSettings(ApiModel):
    """Engine settings of one role's workers."""

    model_config = ConfigDict(
        json_schema_extra=cel(KV_SIZE_ONCE, BATCH_HOLDS_SEQS, BUDGET_FLOOR_UNDER_CEILING)
    )

    max_num_batched_tokens: int = Field(
        default=2048, ge=1, le=1 << 20, description="Token budget of one engine step (chunk size)."
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Most running sequences.")
    num_kv_blocks: int | None = Field(default=None, ge=1, le=1 << 24, description="KV blocks.")
    kv_cache_memory: Quantity | None = Field(
        default=None, description="KV cache size in bytes, e.g. 4Gi (instead of numKvBlocks)."
    )
    token_budget: TokenBudgetSpec = TokenBudgetSpec()

    # max_num_batched_tokens is validated first: it is in info.data if it was valid.
    @field_validator("token_budget")
    @classmethod
    def _check_budget(cls, budget: TokenBudgetSpec, info: ValidationInfo) -> TokenBudgetSpec:
        if budget.max_budget is not None:
            ceiling = budget.max_budget
        elif budget.mode == "adaptive" and "max_num_batched_tokens" in info.data:
            ceiling = info.data["max_num_batched_tokens"]
        else:
            return budget
        if budget.min_budget > ceiling:
            raise refuse(BUDGET_FLOOR_UNDER_CEILING)
        return budget

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise refuse(KV_SIZE_ONCE)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise refuse(BATCH_HOLDS_SEQS)
        return self


class ResourceRequirements(ApiModel):
    """Compute resources of one container (GPUs go in `gpus`)."""

    requests: QuantityMap = Field(default_factory=dict)
    limits: QuantityMap = Field(default_factory=dict)


class Toleration(ApiModel):
    """A Kubernetes toleration."""

    model_config = ConfigDict(json_schema_extra=cel(EXISTS_TAKES_NO_VALUE))

    key: ShortStr | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise refuse(EXISTS_TAKES_NO_VALUE)
        return self


class KeyRef(ApiModel):
    """A key of a Secret or ConfigMap."""

    name: ShortStr
    key: ShortStr
    optional: bool | None = None


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from."""

    model_config = ConfigDict(json_schema_extra=cel(ENV_SOURCE_ONE))

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None

    @model_validator(mode="after")
    def _check(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise refuse(ENV_SOURCE_ONE)
        return self


class EnvVar(ApiModel):
    """An environment variable of a container."""

    model_config = ConfigDict(json_schema_extra=cel(ENV_VALUE_ONCE))

    name: Annotated[str, StringConstraints(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")] = Field(
        max_length=256
    )
    value: str | None = Field(default=None, max_length=32768)
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _check(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise refuse(ENV_VALUE_ONCE)
        return self


class Placement(ApiModel):
    """Pod settings shared by worker pools and the router."""

    resources: ResourceRequirements = ResourceRequirements()
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = Field(default=(), max_length=32)
    env: tuple[EnvVar, ...] = Field(default=(), max_length=64)


# --- rollouts ------------------------------------------------------------------------

RolloutType = Literal["replace", "canary"]
RolloutPhase = Literal["Progressing", "Paused", "Completed", "RolledBack", "Aborted"]
RolloutAction = Literal["wait", "promote", "complete", "rollback", "abort"]
RollbackConditionName = Literal[
    "itlOverTarget",
    "preemptionsWithTtft",
    "shortRequestsSlowed",
    "utilisationUpGoodputDown",
    "errorRates",
]


class RolloutStep(ApiModel):
    """One step of a canary: the new revision's share of the role's traffic (and, unless
    `workers` says otherwise, of its workers), held for `analysisSeconds` while the
    canary is judged against the stable revision."""

    weight: int = Field(
        ge=1, le=99, description="Percent of the role's requests sent to the new revision."
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Percent of the role's workers running the new revision (default: "
        "weight; at least one worker).",
    )
    analysis_seconds: int = Field(
        default=300,
        ge=1,
        le=86400,
        description="How long the step is judged before the canary is promoted.",
    )


def _ratio(default: float | None) -> Any:
    return Field(default=default, gt=0, le=1e6)


def _threshold(default: float | None) -> Any:
    return Field(default=default, ge=0, le=1e9)


class RollbackCondition(ApiModel):
    """One rollback condition: it fires when its figure for the canary passes
    `threshold` (an absolute bound, where the condition has one) or `baselineRatio`
    times the stable revision's figure over the same window, and stays there for
    `durationSeconds`."""

    enabled: bool = True
    threshold: float | None = _threshold(None)
    baseline_ratio: float | None = _ratio(None)
    duration_seconds: int = Field(default=60, ge=0, le=86400)


class ItlOverTarget(RollbackCondition):
    """P99 ITL over the pool's ITL target (threshold: a multiple of the target) for
    durationSeconds."""

    threshold: float | None = _threshold(1.0)
    duration_seconds: int = Field(default=600, ge=0, le=86400)


class PreemptionsWithTtft(RollbackCondition):
    """The preemption rate and TTFT P95 both above baselineRatio times the stable
    revision's."""

    baseline_ratio: float | None = _ratio(1.5)


class ShortRequestsSlowed(RollbackCondition):
    """Short requests' (the first bucket's) P95 end-to-end latency at baselineRatio
    times the stable revision's: long prompts stalling short ones."""

    baseline_ratio: float | None = _ratio(2.0)


class UtilisationUpGoodputDown(RollbackCondition):
    """KV cache utilisation above the stable revision's while goodput (the share of
    requests meeting the SLO) falls under baselineRatio times its."""

    baseline_ratio: float | None = _ratio(0.9)


class ErrorRates(RollbackCondition):
    """The error, cancel or timeout rate above baselineRatio times the stable
    revision's and above threshold (a share of requests)."""

    threshold: float | None = _threshold(0.01)
    baseline_ratio: float | None = _ratio(1.5)


class RollbackConditions(ApiModel):
    """The conditions a canary is rolled back on, defined before the change. Each is
    judged per input-length bucket of the routing table."""

    itl_over_target: ItlOverTarget = ItlOverTarget()
    preemptions_with_ttft: PreemptionsWithTtft = PreemptionsWithTtft()
    short_requests_slowed: ShortRequestsSlowed = ShortRequestsSlowed()
    utilisation_up_goodput_down: UtilisationUpGoodputDown = UtilisationUpGoodputDown()
    error_rates: ErrorRates = ErrorRates()


class RolloutStrategy(ApiModel):
    """How a change to what a role's workers run reaches them. `replace`: every worker
    at once (a Deployment rollout). `canary`: a new revision beside the stable one,
    through `steps`, judged on `conditions` at each, completed after the last or rolled
    back when one fires."""

    model_config = ConfigDict(json_schema_extra=cel(CANARY_NEEDS_STEPS))

    type: RolloutType = "replace"
    steps: tuple[RolloutStep, ...] = Field(
        default=(),
        max_length=16,
        json_schema_extra=cel(STEPS_ASCENDING),
        description="The canary's steps, its weight growing step by step.",
    )
    min_requests: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="Requests each revision must serve in a step's window before it is "
        "judged (fewer: the step waits; a canary is never promoted on no evidence).",
    )
    conditions: RollbackConditions = RollbackConditions()

    @field_validator("steps")
    @classmethod
    def _ascending(cls, steps: tuple[RolloutStep, ...]) -> tuple[RolloutStep, ...]:
        weights = [step.weight for step in steps]
        if any(low >= high for low, high in itertools.pairwise(weights)):
            raise refuse(STEPS_ASCENDING)
        return steps

    @model_validator(mode="after")
    def _check(self) -> RolloutStrategy:
        if self.type == "canary" and not self.steps:
            raise refuse(CANARY_NEEDS_STEPS)
        return self


class WorkerPool(Placement):
    """One role's workers (prefill or decode)."""

    model_config = ConfigDict(json_schema_extra=cel(GPUS_BY_FIELD))

    replicas: int = Field(default=1, ge=0, le=1000, description="Workers (0: none of this role).")
    gpus: int = Field(default=0, ge=0, le=16, description=f"GPUs ({GPU_RESOURCE}) per worker.")
    engine: EngineSettings = EngineSettings()
    drain_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="How long a stopping worker lets its requests in flight and its KV "
        "hand-offs finish (sizes the pods' terminationGracePeriodSeconds).",
    )  # fmt: skip
    rollout: RolloutStrategy = Field(
        default=RolloutStrategy(),
        description="How a change to these workers' engine settings, image, model or flags "
        "is rolled out.",
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerPool:
        if GPU_RESOURCE in self.resources.limits or GPU_RESOURCE in self.resources.requests:
            raise refuse(GPUS_BY_FIELD)
        return self


class RouterSpec(Placement):
    """The router: the pool's OpenAI-compatible front door."""

    replicas: int = Field(default=1, ge=0, le=100)
    service_type: ServiceType = "ClusterIP"
    api_keys: KeyRef | None = Field(
        default=None,
        description="A key of a Secret holding the API keys clients must present "
        "(Authorization: Bearer), one per line; absent: no key is asked for.",
    )
    allow_direct_clients: bool = Field(
        default=False,
        description="Let clients call the workers' OpenAI endpoints (/v1/*, /tokenize, "
        "/detokenize) without the pool's credential, bypassing this router's API keys and "
        "limits; the NetworkPolicy then admits the pods of the pool's namespace to the "
        "workers' http port. Default: only the router may.",
    )


class KvTransferSpec(ApiModel):
    """How prefill workers hand KV caches to decode workers."""

    backend: TransferBackend = Field(
        default="nixl", description="nixl (UCX) or torch (gloo on CPU, NCCL on GPU)."
    )
    failure_policy: FailurePolicy = Field(
        default="recompute",
        description="On a failed transfer: recompute the prompt on decode, or fail the request.",
    )


class Bucket(ApiModel):
    """Prompts of at most maxInputTokens tokens take this bucket's path."""

    max_input_tokens: int | None = Field(
        default=None, ge=1, le=1 << 22, description="Upper bound (inclusive); absent: no bound."
    )
    mode: RoutingMode = Field(description="colocated: decode prefills; disaggregated: P -> D.")


class RoutingSpec(ApiModel):
    """How the router picks workers, and length buckets: a prompt takes the first
    bucket that holds it."""

    policy: RoutingPolicy = Field(
        default="kv-aware",
        description="kv-aware: the worker with the least predicted time to first token, its "
        "prompt tokens not in its prefix cache (the router follows every worker's KV events) "
        "after those waiting in it, at the cost per token and per decoding request each "
        "worker measures on its own steps; the bucket is chosen on the tokens the chosen "
        "decode worker lacks. load: the least loaded worker, the bucket on the prompt's "
        "length.",
    )
    load_weight_tokens: int | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        description="kv-aware: count a worker's cost in prompt tokens instead of predicted "
        "time, one request it holds weighing this many (absent: predicted time).",
    )

    buckets: tuple[Bucket, ...] = Field(
        default=(Bucket(mode="colocated"),),
        min_length=1,
        max_length=8,
        json_schema_extra=cel(ONLY_LAST_BUCKET_UNBOUNDED, BUCKETS_ASCENDING),
    )

    @field_validator("buckets")
    @classmethod
    def _check_buckets(cls, buckets: tuple[Bucket, ...]) -> tuple[Bucket, ...]:
        if any(b.max_input_tokens is None for b in buckets[:-1]):
            raise refuse(ONLY_LAST_BUCKET_UNBOUNDED)
        bounds = [b.max_input_tokens for b in buckets if b.max_input_tokens is not None]
        if any(low >= high for low, high in itertools.pairwise(bounds)):
            raise refuse(BUCKETS_ASCENDING)
        return buckets

    @property
    def disaggregated(self) -> bool:
        """Whether any bucket sends prompts through a prefill worker."""
        return any(b.mode == "disaggregated" for b in self.buckets)


class LatencyTarget(ApiModel):
    """A latency objective: the given percentile stays under `seconds`."""

    seconds: float = Field(gt=0, le=3600)
    percentile: float = Field(default=95.0, gt=0, le=100)


class SloSpec(ApiModel):
    """Latency targets (TTFT: time to first token; ITL: gap between tokens)."""

    ttft: LatencyTarget | None = None
    itl: LatencyTarget | None = None


class RoleScaling(ApiModel):
    """Replica bounds of one role."""

    model_config = ConfigDict(json_schema_extra=cel(MIN_NOT_ABOVE_MAX))

    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=0, le=1000)

    @model_validator(mode="after")
    def _check(self) -> RoleScaling:
        if self.min_replicas > self.max_replicas:
            raise refuse(MIN_NOT_ABOVE_MAX)
        return self


class RatioBound(ApiModel):
    """Bounds on prefill workers per decode worker (e.g. max 0.5: at most one prefill
    worker for every two decode workers)."""

    model_config = ConfigDict(json_schema_extra=cel(RATIO_MIN_NOT_ABOVE_MAX))

    min: float | None = Field(default=None, ge=0, le=100)
    max: float | None = Field(default=None, gt=0, le=100)

    @model_validator(mode="after")
    def _check(self) -> RatioBound:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise refuse(RATIO_MIN_NOT_ABOVE_MAX)
        return self


class ScalingPolicy(ApiModel):
    """What scales the workers, how fast, and on what."""

    type: Scaler = Field(
        default="planner",
        description="planner: the operator's SLO planner; hpa: HorizontalPodAutoscalers on "
        "external metrics (an external metrics adapter must serve them); keda: KEDA "
        "ScaledObjects with Prometheus triggers.",
    )
    prometheus_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="Prometheus scraping the pool (default: the operator's --prometheus-url).",
    )
    interval_seconds: int = Field(default=30, ge=1, le=3600, description="Time between decisions.")
    window_seconds: int = Field(
        default=60, ge=2, le=3600, description="Latencies and rates are taken over this window."
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600,
        description="Scale up to the lowest recommendation of this window.",
    )  # fmt: skip
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600,
        description="Scale down to the highest recommendation of this window.",
    )  # fmt: skip
    cooldown_seconds: int = Field(
        default=60, ge=0, le=3600, description="No change to a role this soon after its last one."
    )
    max_scale_up_step: int = Field(
        default=2, ge=1, le=100, description="Most workers added at once."
    )
    max_scale_down_step: int = Field(
        default=1, ge=1, le=100, description="Most workers removed at once."
    )
    kv_cache_usage_high: float = Field(
        default=0.85, gt=0, le=1, description="Decode KV cache usage that calls for more workers."
    )
    prefill_queue_high: float = Field(
        default=4.0, gt=0, le=10000,
        description="Requests waiting per prefill worker that call for more workers.",
    )  # fmt: skip
    scale_down_latency_ratio: float = Field(
        default=0.7, gt=0, lt=1,
        description="Scale down only while latencies stay under this fraction of their target.",
    )  # fmt: skip
    min_requests: int = Field(
        default=10, ge=1, le=1000000,
        description="Requests a window needs before its latency percentiles count.",
    )  # fmt: skip
    prefill_decode_ratio: RatioBound | None = Field(
        default=None, description="Bounds on prefill workers per decode worker."
    )


class AutoscalingSpec(ApiModel):
    """SLO-driven scaling of each role, within its bounds."""

    model_config = ConfigDict(json_schema_extra=cel(HPA_NEEDS_ONE_REPLICA, RATIO_WITHIN_REPLICAS))

    enabled: bool = False
    prefill: RoleScaling = RoleScaling()
    decode: RoleScaling = RoleScaling()
    policy: ScalingPolicy = ScalingPolicy()

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSpec:
        lowest = min(self.prefill.min_replicas, self.decode.min_replicas)
        if self.policy.type == "hpa" and lowest < 1:
            raise refuse(HPA_NEEDS_ONE_REPLICA)
        # A bound the replica bounds cannot meet (a plan's, for other bounds) would
        # hold the planner still whatever the SLOs say.
        ratio = self.policy.prefill_decode_ratio
        if ratio is not None and (
            (
                ratio.min is not None
                and ratio.min * self.decode.min_replicas > self.prefill.max_replicas
            )
            or (
                ratio.max is not None
                and ratio.max * self.decode.max_replicas < self.prefill.min_replicas
            )
        ):
            raise refuse(RATIO_WITHIN_REPLICAS)
        return self

    def bounds(self, role: Role) -> RoleScaling:
        """The replica bounds of a role."""
        return self.prefill if role == "prefill" else self.decode


class ServiceMonitorSpec(ApiModel):
    """A Prometheus Operator ServiceMonitor for the pool's metrics."""

    enabled: bool = False
    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$", max_length=16)
    labels: LabelMap = Field(default_factory=dict)


class MonitoringSpec(ApiModel):
    """Monitoring objects rendered with the pool."""

    service_monitor: ServiceMonitorSpec = ServiceMonitorSpec()
    scrape_annotations: bool = Field(
        default=True,
        description="Annotate the pool's pods with prometheus.io/scrape, port and path, for "
        "a Prometheus that discovers pods by them.",
    )
    prometheus_namespace: str | None = Field(
        default=None,
        max_length=63,
        pattern=NAMESPACE_NAME,
        description="The namespace of the Prometheus that scrapes the pool: the "
        "NetworkPolicy admits its pods to the workers' http port (/metrics). Default: the "
        "operator's --prometheus-namespace; neither set: no pod outside the pool reaches "
        "the workers.",
    )


class ServingPoolSpec(ApiModel):
    """A model served by prefill and decode workers behind a router."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            DISAGGREGATED_NEEDS_PREFILL,
            AUTOSCALING_NEEDS_SLO,
            PREFILL_BUDGET_NEEDS_TARGET,
            DECODE_BUDGET_NEEDS_TARGET,
        )
    )

    model: ModelSpec
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="pdserve container image (default: the operator's --default-image).",
    )
    image_pull_policy: PullPolicy = "IfNotPresent"
    kv_cache: KvCacheSpec = KvCacheSpec()
    prefill: WorkerPool | None = Field(
        default=None, description="Prefill workers; needed by disaggregated buckets only."
    )
    decode: WorkerPool = WorkerPool()
    kv_transfer: KvTransferSpec = KvTransferSpec()
    routing: RoutingSpec = RoutingSpec()
    router: RouterSpec = RouterSpec()
    slo: SloSpec | None = None
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    monitoring: MonitoringSpec = MonitoringSpec()

    # Fields are validated in order: prefill and slo are in info.data when routing and
    # autoscaling are checked (absent if they were themselves invalid).
    @field_validator("routing")
    @classmethod
    def _check_routing(cls, routing: RoutingSpec, info: ValidationInfo) -> RoutingSpec:
        if routing.disaggregated and "prefill" in info.data and info.data["prefill"] is None:
            raise refuse(DISAGGREGATED_NEEDS_PREFILL)
        return routing

    @field_validator("autoscaling")
    @classmethod
    def _check_autoscaling(
        cls, autoscaling: AutoscalingSpec, info: ValidationInfo
    ) -> AutoscalingSpec:
        if autoscaling.enabled and "slo" in info.data and info.data["slo"] is None:
            raise refuse(AUTOSCALING_NEEDS_SLO)
        return autoscaling

    @model_validator(mode="after")
    def _check_budget_targets(self) -> ServingPoolSpec:
        for role in ROLES:
            workers = self.pool(role)
            if workers is None or workers.engine.token_budget.mode != "adaptive":
                continue
            if self.target_itl_ms(role) is None:
                raise refuse(BUDGET_NEEDS_TARGET[role])
        return self

    def worker_role(self, role: Role) -> WorkerRole:
        """The `--role` a pool's workers run: decode prefills too unless prefill exists."""
        if role == "decode" and self.prefill is None:
            return "both"
        return role

    def pool(self, role: Role) -> WorkerPool | None:
        """The worker pool of a role (None: the pool has no such role)."""
        return self.prefill if role == "prefill" else self.decode

    def target_itl_ms(self, role: Role) -> float | None:
        """A role's ITL target: its token budget's own, else the pool's ITL SLO."""
        workers = self.pool(role)
        if workers is not None and workers.engine.token_budget.target_itl_ms is not None:
            return workers.engine.token_budget.target_itl_ms
        if self.slo is not None and self.slo.itl is not None:
            return self.slo.itl.seconds * 1000.0
        return None


# --- status --------------------------------------------------------------------------


class Condition(ApiModel):
    """One aspect of the pool's state (as metav1.Condition)."""

    type: ConditionType
    status: ConditionStatus
    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    )
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(default=None, ge=0)


class RoleStatus(ApiModel):
    """Replica counts of one role; `summary` is "ready/desired" for kubectl get."""

    desired_replicas: int = Field(default=0, ge=0)
    ready_replicas: int = Field(default=0, ge=0)
    summary: str = Field(default="", max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _fill_summary(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and not data.get("summary"):
            desired = data.get("desired_replicas", data.get("desiredReplicas", 0))
            ready = data.get("ready_replicas", data.get("readyReplicas", 0))
            return {**data, "summary": f"{ready}/{desired}"}
        return data


class ScalingInputs(ApiModel):
    """What a scaling decision read from Prometheus, over the policy's window (absent:
    no data). Latencies are at the SLO's percentile; loads are per worker."""

    request_rate: float | None = Field(default=None, description="Requests per second.")
    ttft_colocated_seconds: float | None = None
    ttft_disaggregated_seconds: float | None = None
    itl_seconds: float | None = None
    prefill_waiting: float | None = None
    prefill_running: float | None = None
    decode_running: float | None = None
    kv_cache_usage: float | None = None


class RoleScalingStatus(ApiModel):
    """The autoscaler's last word on one role."""

    replicas: int = Field(ge=0, description="Workers the autoscaler wants.")
    reason: str = Field(max_length=64)
    message: str = Field(default="", max_length=1024)
    last_scale_time: datetime | None = None


class AutoscalingStatus(ApiModel):
    """The autoscaler's last decision: its inputs and, per role, its outcome."""

    last_decision_time: datetime | None = None
    inputs: ScalingInputs | None = None
    prefill: RoleScalingStatus | None = None
    decode: RoleScalingStatus | None = None

    def role(self, role: Role) -> RoleScalingStatus | None:
        """The outcome for one role."""
        return self.prefill if role == "prefill" else self.decode


class CreatedSecret(ApiModel):
    """A Secret the operator created for the pool (it reads no Secret: this record is
    how it knows the pool's credential Secret is its own)."""

    name: ShortStr
    uid: str = Field(max_length=128)


class RevisionFigures(ApiModel):
    """One revision's figures over an analysis window, in the bucket a decision names
    (rates are shares of its requests; absent: no data)."""

    requests: float = Field(default=0, ge=0)
    itl_p99_seconds: float | None = None
    ttft_p95_seconds: float | None = None
    ttft_p99_seconds: float | None = None
    short_e2e_p95_seconds: float | None = None
    preemption_rate: float | None = None
    goodput: float | None = None
    kv_cache_usage: float | None = None
    error_rate: float | None = None
    cancel_rate: float | None = None
    timeout_rate: float | None = None


class RolloutDecision(ApiModel):
    """A rollout's last decision and what it was made on."""

    action: RolloutAction
    reason: str = Field(max_length=64, description="The condition that fired, or why.")
    message: str = Field(default="", max_length=1024)
    bucket: str | None = Field(default=None, max_length=32)
    canary: RevisionFigures | None = None
    baseline: RevisionFigures | None = None
    time: datetime


class RoleRolloutStatus(ApiModel):
    """A role's rollout: its revisions, its step and its last decision."""

    phase: RolloutPhase
    stable_revision: str = Field(max_length=63)
    canary_revision: str | None = Field(default=None, max_length=63)
    step: int = Field(default=0, ge=0, description="The step in force (0-based).")
    weight: int = Field(default=0, ge=0, le=100, description="The canary's traffic percent.")
    step_started_time: datetime | None = None
    last_decision: RolloutDecision | None = None


class RolloutStatus(ApiModel):
    """The pool's rollouts; `phase` is the most pressing of the roles' (for kubectl get)."""

    phase: RolloutPhase | None = None
    prefill: RoleRolloutStatus | None = None
    decode: RoleRolloutStatus | None = None

    def role(self, role: Role) -> RoleRolloutStatus | None:
        """The rollout of one role."""
        return self.prefill if role == "prefill" else self.decode


class ServingPoolStatus(ApiModel):
    """What the operator observed and did."""

    observed_generation: int | None = Field(default=None, ge=0)
    phase: Phase | None = None
    conditions: tuple[Condition, ...] = Field(
        default=(),
        max_length=8,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    router: RoleStatus | None = None
    router_endpoint: str | None = Field(default=None, max_length=1024)
    credential_secret: CreatedSecret | None = Field(
        default=None, description="The Secret holding the pool's internal credential."
    )
    autoscaling: AutoscalingStatus | None = None
    rollout: RolloutStatus | None = None

    def condition(self, type_: ConditionType) -> Condition | None:
        """The condition of a type, if set."""
        return next((c for c in self.conditions if c.type == type_), None)


def with_condition(
    conditions: Sequence[Condition],
    type_: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    *,
    generation: int | None = None,
    now: datetime | None = None,
) -> tuple[Condition, ...]:
    """Conditions with one set; lastTransitionTime moves only when the status changes."""
    previous = next((c for c in conditions if c.type == type_), None)
    if previous is not None and previous.status == status:
        when = previous.last_transition_time
    else:
        when = (now or datetime.now(UTC)).replace(microsecond=0)
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=when,
        observed_generation=generation,
    )
    if previous is None:
        return (*conditions, new)
    return tuple(new if c.type == type_ else c for c in conditions)


def without_condition(
    conditions: Sequence[Condition], type_: ConditionType
) -> tuple[Condition, ...]:
    """Conditions without the one of a type."""
    return tuple(c for c in conditions if c.type != type_)


# --- the whole object ----------------------------------------------------------------


class PoolMetadata(BaseModel):
    """The metadata fields pdserve reads (others are kept by Kubernetes, ignored here)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    namespace: str = Field(default="default", max_length=63)
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if len(name) > MAX_POOL_NAME or not re.fullmatch(DNS_LABEL, name):
            raise refuse(NAME_RULE)
        return name


class ServingPool(ApiModel):
    """A `ServingPool` manifest."""

    api_version: Literal["pdserve.dev/v1alpha1"] = "pdserve.dev/v1alpha1"
    kind: Literal["ServingPool"] = "ServingPool"
    metadata: PoolMetadata
    spec: ServingPoolSpec
    status: ServingPoolStatus | None = None


class InvalidPoolError(ValueError):
    """A manifest that breaks the API; `errors` name each field ("spec.decode.replicas: ...")."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = tuple(errors)
        super().__init__("invalid ServingPool:\n  " + "\n  ".join(self.errors))


def field_path(loc: Sequence[str | int]) -> str:
    """A pydantic error location as a manifest path: spec.routing.buckets[1].mode."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def describe_errors(exc: ValidationError, prefix: str = "") -> tuple[str, ...]:
    """One line per error, each starting with the field it is about."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = (prefix, *error["loc"]) if prefix else error["loc"]
        lines.append(f"{field_path(loc) or '<root>'}: {error['msg']}")
    return tuple(lines)


def parse_pool(manifest: Mapping[str, Any]) -> ServingPool:
    """Validate a whole manifest; raises InvalidPoolError naming every bad field."""
    try:
        # Manifests are camelCase only: the API server would drop a snake_case key.
        return ServingPool.model_validate(manifest, by_name=False)
    except ValidationError as exc:
        raise InvalidPoolError(describe_errors(exc)) from None


def parse_spec(spec: Mapping[str, Any]) -> ServingPoolSpec:
    """Validate a spec (as the operator receives it); raises InvalidPoolError."""
    try:
        return ServingPoolSpec.model_validate(spec, by_name=False)
    except ValidationError as exc:
        raise InvalidPoolError(describe_errors(exc, "spec")) from None


def with_image(spec: ServingPoolSpec, default: str | None) -> ServingPoolSpec:
    """The spec with its image, the operator's default where the pool names none;
    raises InvalidPoolError when neither is set."""
    if spec.image is not None:
        return spec
    if default is None:
        raise InvalidPoolError(["spec.image: required (the operator has no --default-image)"])
    return spec.model_copy(update={"image": default})


def dump(model: BaseModel) -> dict[str, Any]:
    """A model as manifest data: camelCase keys, unset optional fields left out."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
