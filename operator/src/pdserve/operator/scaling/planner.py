"""The SLO planner: how many prefill and decode workers a pool should run, from what
Prometheus reports about it. Pure: observations and the planner's memory in, one
decision per role and the new memory out; no clock, no I/O.

Each role gets a recommendation from its signals, each signal a pressure (its value
over its threshold, 1.0 on the line):

  prefill  TTFT of disaggregated requests (the prefill pool computes their first
           token) and requests waiting per prefill worker;
  decode   ITL, TTFT of colocated requests (decode workers prefill those), KV cache
           usage and running requests per decode worker (against maxNumSeqs).

A pressure above 1 scales up in proportion (`ceil(replicas x pressure)`), as a
HorizontalPodAutoscaler does. Scaling down needs every latency and every load, spread
over one worker fewer (x replicas / (replicas - 1)), under `scaleDownLatencyRatio` of
its target or threshold: between the two lines the planner holds,
so noise around a target does not make it flap. Latency percentiles count only over
windows with at least `minRequests` requests; with fewer, busy workers are not taken
away (their latencies cannot be judged).

The recommendation then passes, in order: the role's min/max; the stabilisation
windows (up to the lowest recommendation of the up window, down to the highest of
the down window, and down only once the planner has watched a whole down window);
the step limits; the cooldown since the role last changed; a hold on scaling up
while the last scale-up's workers are not ready; and the bound on prefill workers
per decode worker, which caps a role's move instead of dragging the other along.
Replicas outside min/max are brought inside at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from pdserve.operator import api

Mode = Literal["colocated", "disaggregated"]
Direction = Literal["up", "down", "none"]

# Batch slots a decode worker may fill before it counts as saturated.
BATCH_FULL = 0.9
ROLES = api.ROLES
History = tuple[tuple[float, int], ...]  # (time, recommended replicas), oldest first


@dataclass(frozen=True)
class RoleLoad:
    """One role's workers as their gauges report them, averaged over the window."""

    workers: int  # workers reporting now
    waiting: float  # requests waiting per worker
    running: float  # requests running per worker
    kv_cache_usage: float  # fraction of KV blocks in use, per worker


@dataclass(frozen=True)
class Observation:
    """What Prometheus says about a pool over the window (None: no data)."""

    request_rate: float | None = None  # requests per second
    requests: float | None = None  # requests ended in the window
    disaggregated_rate: float | None = None  # requests routed to disaggregated buckets, per s
    ttft: Mapping[Mode, float] = field(default_factory=dict)  # at the SLO's percentile
    itl: float | None = None  # at the SLO's percentile
    prefill: RoleLoad | None = None
    decode: RoleLoad | None = None

    def load(self, role: api.Role) -> RoleLoad | None:
        """The load of a role's workers."""
        return self.prefill if role == "prefill" else self.decode

    def inputs(self) -> api.ScalingInputs:
        """The observation as the pool's status shows it."""

        def rounded(value: float | None) -> float | None:
            return None if value is None else float(f"{value:.4g}")

        prefill, decode = self.prefill, self.decode
        return api.ScalingInputs(
            request_rate=rounded(self.request_rate),
            ttft_colocated_seconds=rounded(self.ttft.get("colocated")),
            ttft_disaggregated_seconds=rounded(self.ttft.get("disaggregated")),
            itl_seconds=rounded(self.itl),
            prefill_waiting=rounded(prefill.waiting if prefill else None),
            prefill_running=rounded(prefill.running if prefill else None),
            decode_running=rounded(decode.running if decode else None),
            kv_cache_usage=rounded(decode.kv_cache_usage if decode else None),
        )


@dataclass(frozen=True)
class Replicas:
    """A role's workers now: wanted (the last decision) and ready."""

    current: int
    ready: int


@dataclass(frozen=True)
class Decision:
    """The planner's word on one role."""

    role: api.Role
    current: int
    desired: int
    reason: str  # CamelCase, for conditions and Events
    message: str

    @property
    def direction(self) -> Direction:
        """Whether the role grows, shrinks or stays."""
        if self.desired > self.current:
            return "up"
        return "down" if self.desired < self.current else "none"


@dataclass(frozen=True)
class Memory:
    """What the planner remembers between decisions: recent recommendations (time,
    replicas) per role, when each role last changed, and since when it watches."""

    since: float | None = None
    recommendations: Mapping[api.Role, History] = field(default_factory=dict)
    last_scale: Mapping[api.Role, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    """What the planner needs of a pool's spec."""

    slo: api.SloSpec
    autoscaling: api.AutoscalingSpec
    roles: tuple[api.Role, ...]  # the roles the pool has
    max_num_seqs: Mapping[api.Role, int]

    @classmethod
    def of(cls, spec: api.ServingPoolSpec) -> Settings:
        """The settings of a pool."""
        roles = tuple(role for role in ROLES if spec.pool(role) is not None)
        seqs = {role: pool.engine.max_num_seqs for role in roles if (pool := spec.pool(role))}
        return cls(spec.slo or api.SloSpec(), spec.autoscaling, roles, seqs)

    @property
    def policy(self) -> api.ScalingPolicy:
        """The scaling policy."""
        return self.autoscaling.policy

    @property
    def longest_window(self) -> float:
        """The longest stabilisation window."""
        policy = self.policy
        return max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)


@dataclass(frozen=True)
class Pressure:
    """One signal measured against its threshold."""

    name: str  # what it is, for messages ("TTFT p95 (disaggregated)")
    reason: str  # the reason a scale-up on it gives
    value: float
    threshold: float
    latency: bool  # latencies do not fall in proportion to replicas

    @property
    def ratio(self) -> float:
        """Value over threshold: above 1 calls for more workers."""
        return self.value / self.threshold

    def describe(self) -> str:
        """ "TTFT p95 (disaggregated) 1.84 over 1.00" for messages."""
        relation = "over" if self.ratio > 1 else "under"
        return f"{self.name} {self.value:.3g} {relation} {self.threshold:.3g}"


# --- signals -------------------------------------------------------------------------


def _percentile(target: api.LatencyTarget) -> str:
    return f"p{target.percentile:g}"


def _latencies(settings: Settings, observation: Observation, role: api.Role) -> list[Pressure]:
    """The latency pressures of a role (none when the window holds too few requests)."""
    if (observation.requests or 0.0) < settings.policy.min_requests:
        return []
    slo, out = settings.slo, []
    # Without a prefill pool every request is prefilled by the decode workers.
    ttft_modes: tuple[Mode, ...] = ("disaggregated",) if role == "prefill" else ("colocated",)
    if role == "decode" and "prefill" not in settings.roles:
        ttft_modes = ("colocated", "disaggregated")
    if slo.ttft is not None:
        for mode in ttft_modes:
            value = observation.ttft.get(mode)
            if value is not None:
                name = f"TTFT {_percentile(slo.ttft)} ({mode})"
                out.append(Pressure(name, "TTFTAboveTarget", value, slo.ttft.seconds, True))
    if role == "decode" and slo.itl is not None and observation.itl is not None:
        name = f"ITL {_percentile(slo.itl)}"
        out.append(Pressure(name, "ITLAboveTarget", observation.itl, slo.itl.seconds, True))
    return out


def _unjudged(settings: Settings, observation: Observation, role: api.Role) -> bool:
    """Whether the role has a latency target the window holds too few requests to judge
    (long streams end rarely: their latencies are counted when they end)."""
    if (observation.requests or 0.0) >= settings.policy.min_requests:
        return False
    slo = settings.slo
    return slo.ttft is not None or (role == "decode" and slo.itl is not None)


def _loads(settings: Settings, observation: Observation, role: api.Role) -> list[Pressure]:
    """The load pressures of a role, per worker."""
    load, policy = observation.load(role), settings.policy
    if load is None:
        return []
    if role == "prefill":
        queue = Pressure(
            "requests waiting per prefill worker", "PrefillQueueHigh",
            load.waiting, policy.prefill_queue_high, False,
        )  # fmt: skip
        return [queue]
    batch = BATCH_FULL * settings.max_num_seqs.get(role, 1)
    return [
        Pressure(
            "KV cache usage", "KVCacheUsageHigh", load.kv_cache_usage,
            policy.kv_cache_usage_high, False,
        ),
        Pressure("requests running per decode worker", "BatchFull", load.running, batch, False),
    ]  # fmt: skip


def recommend(
    settings: Settings, observation: Observation, role: api.Role, current: int
) -> tuple[int, str, str]:
    """The replicas a role's signals call for, before any limit: (replicas, reason,
    message)."""
    if role == "prefill" and current == 0 and (observation.disaggregated_rate or 0.0) > 0:
        return 1, "DisaggregatedTraffic", "disaggregated requests and no prefill worker"
    latencies = _latencies(settings, observation, role)
    loads = _loads(settings, observation, role)
    pressures = latencies + loads
    worst = max(pressures, key=lambda p: p.ratio, default=None)
    if worst is not None and worst.ratio > 1:
        # The tolerance keeps float noise (0.075 / 0.05 = 1.5000000000000002) out of ceil.
        wanted = max(current + 1, math.ceil(max(current, 1) * worst.ratio - 1e-9))
        return wanted, worst.reason, worst.describe()
    if observation.request_rate == 0.0 and not any(p.value for p in loads):
        return 0, "Idle", "no requests in the window"
    if _unjudged(settings, observation, role) and any(p.value for p in loads):
        requests = observation.requests or 0.0
        why = f"{requests:.0f} requests ended in the window, fewer than minRequests"
        return current, "TooFewRequests", f"{why}: latencies not judged, workers busy"
    ratio = settings.policy.scale_down_latency_ratio
    # One worker fewer spreads the same work over fewer workers: loads and latencies
    # are judged as they would be then (a latency that halves when the workers double
    # would otherwise send a pool between N and N - 1 for ever).
    spread = current / (current - 1) if current > 1 else math.inf
    high_latency = next((p for p in latencies if p.ratio * spread >= ratio), None)
    if current <= 0 or high_latency is not None:
        why = high_latency.describe() if high_latency else "within targets"
        if high_latency is not None and high_latency.ratio < ratio:
            why += ", too slow for one worker fewer"
        return current, "WithinTarget", why
    busy = next((p for p in loads if p.ratio * spread >= ratio), None)
    if busy is not None:
        return current, "WithinTarget", f"{busy.describe()}, too busy for one worker fewer"
    summary = ", ".join(p.describe() for p in pressures) or "no latency or load data"
    return current - 1, "LoadBelowTarget", summary


# --- limits --------------------------------------------------------------------------


def _remember(
    memory: Memory, settings: Settings, role: api.Role, now: float, replicas: int
) -> History:
    keep = now - settings.longest_window
    earlier = memory.recommendations.get(role, ())
    return (*[(t, r) for t, r in earlier if t >= keep], (now, replicas))


def _stabilized(
    settings: Settings,
    history: History,
    since: float,
    now: float,
    current: int,
) -> tuple[int, bool]:
    """The stabilised recommendation, and whether a scale-down waits for its window."""
    policy = settings.policy
    up_window, down_window = (
        policy.scale_up_stabilization_seconds,
        policy.scale_down_stabilization_seconds,
    )
    lowest = min(r for t, r in history if t >= now - up_window)
    if lowest > current:
        return lowest, False
    highest = max(r for t, r in history if t >= now - down_window)
    if highest < current:
        if now - since < down_window:
            return current, True  # not watched a whole window yet (e.g. just started)
        return highest, False
    return current, False


def _bounded(settings: Settings, role: api.Role, replicas: int) -> int:
    bounds = settings.autoscaling.bounds(role)
    return min(max(replicas, bounds.min_replicas), bounds.max_replicas)


def _decide_role(
    settings: Settings,
    observation: Observation,
    role: api.Role,
    replicas: Replicas,
    memory: Memory,
    now: float,
) -> tuple[Decision, History]:
    """One role's decision (before the ratio bound) and its new recommendation history."""
    current, policy = replicas.current, settings.policy
    bounds = settings.autoscaling.bounds(role)
    raw, reason, message = recommend(settings, observation, role, current)
    target = _bounded(settings, role, raw)
    history = _remember(memory, settings, role, now, target)

    def hold(why: str, text: str = message) -> tuple[Decision, History]:
        return Decision(role, current, current, why, text), history

    inside = _bounded(settings, role, current)
    if inside != current:
        text = f"{current} is outside [{bounds.min_replicas}, {bounds.max_replicas}]"
        return Decision(role, current, inside, "OutsideBounds", text), history
    if target == current:
        if raw > current:
            return hold("AtMaxReplicas", f"{message}; at maxReplicas {bounds.max_replicas}")
        if raw < current:
            return hold("AtMinReplicas", f"{message}; at minReplicas {bounds.min_replicas}")
        return hold(reason)
    since = now if memory.since is None else memory.since
    wanted, waiting = _stabilized(settings, history, since, now, current)
    if wanted == current:
        window = "a whole scale-down window" if waiting else "the stabilisation window"
        return hold("Stabilizing", f"{message}; holding {current} for {window}")
    desired = max(wanted, current - policy.max_scale_down_step)
    desired = min(desired, current + policy.max_scale_up_step)
    last = memory.last_scale.get(role)
    if last is not None and now - last < policy.cooldown_seconds:
        left = policy.cooldown_seconds - (now - last)
        return hold("CoolingDown", f"{message}; cooling down for {left:.0f}s more")
    if desired > current and replicas.ready < current:
        starting = current - replicas.ready
        return hold("WaitingForReplicas", f"{message}; {starting} worker(s) not ready yet")
    notes = []
    if target != raw and desired == target:
        edge = "maxReplicas" if raw > target else "minReplicas"
        notes.append(f"{edge} {target}")
    if desired != wanted:
        notes.append(f"{abs(desired - current)} at a time")
    if notes:
        message = f"{message} ({', '.join(notes)})"
    return Decision(role, current, desired, reason, message), history


def _ratio_bound(settings: Settings, decisions: dict[api.Role, Decision]) -> None:
    """Cap moves that would take prefill workers per decode worker past the bound."""
    bound = settings.policy.prefill_decode_ratio
    if bound is None or "prefill" not in decisions or "decode" not in decisions:
        return
    prefill, decode = decisions["prefill"], decisions["decode"]
    p, d = prefill.desired, decode.desired
    if bound.max is not None:
        if prefill.direction == "up" and p > bound.max * d:
            p = max(prefill.current, math.floor(bound.max * d))
        if decode.direction == "down" and p > bound.max * d:
            d = min(decode.current, math.ceil(p / bound.max))
    if bound.min is not None:
        if prefill.direction == "down" and p < bound.min * d:
            p = min(prefill.current, math.ceil(bound.min * d))
        if decode.direction == "up" and bound.min > 0 and p < bound.min * d:
            d = max(decode.current, math.floor(p / bound.min))
    capped: tuple[tuple[api.Role, int], ...] = (("prefill", p), ("decode", d))
    for role, value in capped:
        decision = decisions[role]
        if value != decision.desired:
            why = f"{decision.message}; held at {value} by prefillDecodeRatio"
            decisions[role] = replace(decision, desired=value, reason="RatioLimited", message=why)


def plan(
    settings: Settings,
    observation: Observation,
    replicas: Mapping[api.Role, Replicas],
    memory: Memory,
    now: float,
) -> tuple[dict[api.Role, Decision], Memory]:
    """One decision per role of the pool, and what to remember for the next."""
    since = memory.since if memory.since is not None else now
    memory = replace(memory, since=since)
    decisions: dict[api.Role, Decision] = {}
    histories = dict(memory.recommendations)
    for role in settings.roles:
        decision, histories[role] = _decide_role(
            settings, observation, role, replicas[role], memory, now
        )
        decisions[role] = decision
    _ratio_bound(settings, decisions)
    last_scale = dict(memory.last_scale)
    for role, decision in decisions.items():
        if decision.direction != "none":
            last_scale[role] = now
    return decisions, Memory(since, histories, last_scale)
