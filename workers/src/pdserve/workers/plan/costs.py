"""The profile file: what `pdserve profile` measured on one machine for one model, and
the costs the simulator takes from it.

A step's time is the engine's own step-cost model (`engine.step_cost`): linear in the
decode tokens, prefill tokens and the keys attention reads, with every cost
non-negative; a serving worker adds a fixed time per step and a time per token it
streams. A hand-off costs a fixed time plus a time per byte of KV sent; a request
pays a fixed overhead on its way in (HTTP, tokenization, the router's hop).

A step that carries a prompt's chunk computes slower in a serving worker than the
engine alone in the sweep (`ServingOverhead.mixed_factor`, measured on a real worker
with prompts sent while streams decode, from the steps it logs).

A step's time is not the same twice: the machine's other threads take the cores for
a time slice now and then, a step that waits out such a slice runs several times its
usual time, and the latency tails users see are those steps. The profile keeps the
measured spread (`StepSpread`: each measured step over the typical one), and the
simulator draws each step's from it with a fixed seed.

Workers that share a machine's cores slow each other down: a step runs longer by the
contention while it runs (the threads computing beside it, and the CPU the router and
the load generator spend on requests and streamed tokens), as the profile measured
on this machine with workers stepping together.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.protocol.api_errors import validation_message
from pdserve.workers.engine.step_cost import StepCostEstimate, StepFeatures

PROFILE_FORMAT = 1


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the problem."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class StepCost(_Model):
    """Seconds per unit of each term of a step (see `engine.step_cost`)."""

    base_s: float = Field(ge=0)
    per_decode_token_s: float = Field(ge=0)
    per_prefill_token_s: float = Field(ge=0)
    per_decode_key_s: float = Field(ge=0)
    per_prefill_key_s: float = Field(ge=0)

    @classmethod
    def of(cls, estimate: StepCostEstimate) -> StepCost:
        """The coefficients a fitted step-cost model holds."""
        return cls(
            base_s=estimate.base_s,
            per_decode_token_s=estimate.per_decode_token_s,
            per_prefill_token_s=estimate.per_prefill_token_s,
            per_decode_key_s=estimate.per_decode_key_s,
            per_prefill_key_s=estimate.per_prefill_key_s,
        )

    def seconds(self, features: StepFeatures) -> float:
        """The duration of a step that computes `features`."""
        return (
            self.base_s
            + self.per_decode_token_s * features.decode_tokens
            + self.per_prefill_token_s * features.prefill_tokens
            + self.per_decode_key_s * features.decode_keys
            + self.per_prefill_key_s * features.prefill_keys
        )


class FitError(_Model):
    """How far the fit's predictions fall from the measured steps, as fractions of the
    measured time: over the steps it was fitted on, and over steps held out of it."""

    samples: int = Field(ge=0)
    rounds: int = Field(default=1, ge=1)  # the sweep's passes over its grid
    mean_abs: float = Field(ge=0)
    p90_abs: float = Field(ge=0)
    max_abs: float = Field(ge=0)
    holdout_samples: int = Field(default=0, ge=0)
    holdout_mean_abs: float | None = Field(default=None, ge=0)
    # Whether the fit took the machine's pace (the reference steps) into account, and
    # the in-sample error of a fit that does not (None: no reference steps measured).
    paced: bool = False
    unpaced_mean_abs: float | None = Field(default=None, ge=0)


class StepSample(_Model):
    """One measured step of the sweep."""

    decode_tokens: int = Field(ge=0)
    prefill_tokens: int = Field(ge=0)
    decode_keys: int = Field(ge=0)
    prefill_keys: int = Field(ge=0)
    seconds: float = Field(gt=0)
    # The reference step's time measured beside this one (the machine's pace then);
    # None where the sweep did not measure it.
    reference_s: float | None = Field(default=None, gt=0)
    # The round of the sweep it was measured in (the sweep visits every point once a
    # round); None where the sweep ran in one pass.
    round: int | None = Field(default=None, ge=0)

    @property
    def features(self) -> StepFeatures:
        """The step's features as the cost model takes them."""
        return StepFeatures(
            self.decode_tokens, self.prefill_tokens, self.decode_keys, self.prefill_keys
        )


# The points of a spread kept in a profile: its quantiles at these probabilities.
SPREAD_POINTS = 101
# A step drawn as at most this many pieces of the measured steps' length (see
# `StepSpread.draw`): beyond it the mean of the draws barely moves.
MAX_SPREAD_PIECES = 32


class StepSpread(_Model):
    """How far steps run from their typical time: quantiles (at evenly spaced
    probabilities from 0 to 1) of measured step time over the median of steps that
    compute the same, so the typical step keeps its predicted time and the slow ones
    come out slow. Empty: every step takes its predicted time.

    What makes a step slow is the machine's other work taking a core for a time slice
    while it runs: a slice costs a short step as much time as a long one, so a long
    step is not the measured short ones scaled up. With the typical length of the
    steps it was measured on (`typical_s`), a step that many times longer is drawn as
    that many pieces, each meeting the other work on its own (the mean of as many
    draws): it runs slow about as often, by less of its time."""

    quantiles: tuple[float, ...] = ()
    samples: int = Field(default=0, ge=0)  # steps it was measured on
    # The typical time of the steps it was measured on; None: not recorded, every
    # step draws one ratio whatever its length.
    typical_s: float | None = Field(default=None, gt=0)

    @classmethod
    def of(cls, ratios: Sequence[float], typical_s: float | None = None) -> StepSpread:
        """The spread of measured ratios (step time over its typical time), of steps
        that typically took `typical_s`."""
        kept = [ratio for ratio in ratios if ratio > 0]
        if not kept:
            return cls()
        points = np.quantile(np.asarray(kept), np.linspace(0.0, 1.0, SPREAD_POINTS))
        return cls(
            quantiles=tuple(float(point) for point in points), samples=len(kept),
            typical_s=typical_s,
        )  # fmt: skip

    def pieces(self, seconds: float | None) -> int:
        """How many of the measured steps' lengths a step of `seconds` is drawn as (1:
        no longer than they are, no length given, or none recorded)."""
        if seconds is None or self.typical_s is None or seconds <= self.typical_s:
            return 1
        return min(MAX_SPREAD_PIECES, round(seconds / self.typical_s))

    def draw(self, rng: random.Random, seconds: float | None = None) -> float:
        """A step's time over its typical time, drawn from the spread (1: none): for a
        step of `seconds`, the mean of one draw per piece (`pieces`)."""
        if not self.quantiles:
            return 1.0
        if len(self.quantiles) == 1:
            return self.quantiles[0]
        pieces = self.pieces(seconds)
        return sum(self._one(rng) for _ in range(pieces)) / pieces

    def _one(self, rng: random.Random) -> float:
        position = rng.random() * (len(self.quantiles) - 1)
        below = int(position)
        low, high = self.quantiles[below], self.quantiles[min(below + 1, len(self.quantiles) - 1)]
        return low + (high - low) * (position - below)


class HandoffCost(_Model):
    """A hand-off's time beyond the prefill's compute: fixed plus per byte of KV.

    Measured twice: on the idle pair (`fixed_s`, the transfer and the extra hops) and
    as a pool runs (`pool_s`, the fixed time then: the decode worker, busy with its
    streams and feeds, takes the prefill worker's reply and adopts the KV late). A
    pool's request waits the latter, so it is charged where measured."""

    fixed_s: float = Field(default=0.0, ge=0)
    per_byte_s: float = Field(default=0.0, ge=0)
    backend: str | None = None
    # (bytes, seconds) pairs it was fitted from; empty when not measured.
    samples: tuple[tuple[int, float], ...] = ()
    pool_s: float | None = Field(default=None, ge=0)

    def seconds(self, nbytes: int) -> float:
        """The time to hand `nbytes` of KV cache over, as a request in a pool waits it."""
        fixed = self.fixed_s if self.pool_s is None else self.pool_s
        return fixed + self.per_byte_s * nbytes


# The context of each stream, mid-answer, in the serving measurement (the pair's
# STREAM_PROMPT_TOKENS plus half its STREAM_OUTPUT_TOKENS).
SERVING_CONTEXT = 56


class ServingOverhead(_Model):
    """What a serving worker adds to each of its engine's steps beyond the compute the
    step-cost model measures alone: a fixed time per step and a time per token the
    step streams (the server turns each into an SSE event, in the same interpreter as
    the engine's thread). Measured on a real worker as its steps' cadence (the time
    from one step's tokens to the next's, from its step log) minus the steps'
    predicted compute."""

    fixed_s: float = Field(default=0.0, ge=0)
    per_token_s: float = Field(default=0.0, ge=0)
    # (streams decoding together, seconds each step took beyond its compute).
    samples: tuple[tuple[int, float], ...] = ()
    # The gaps those streams saw, each over the median gap of its batch: a serving
    # worker's steps as its clients see them (its own server's thread, the clients
    # reading, the machine's other work taking a slice now and then).
    spread: StepSpread = StepSpread()
    # A step that carries a prompt's chunk computes slower in a serving worker than
    # the sweep's engine alone (its server's threads, the streams' events and the
    # machine's other work take the cores the chunk's parallel compute waits on): its
    # compute over the step-cost model's, measured from the step log of a worker that
    # is sent prompts while streams decode on it (less what every step takes beyond
    # the model, which the fixed overhead already charges). 1: not measured.
    mixed_factor: float = Field(default=1.0, gt=0)
    # (prompt tokens, that step's compute over the model's) of each prompt step logged.
    mixed_samples: tuple[tuple[int, float], ...] = ()

    def seconds(self, tokens: int) -> float:
        """What a step that streams `tokens` tokens takes beyond its compute."""
        return self.fixed_s + self.per_token_s * tokens

    def drawn_spread(self, cost: StepCost) -> StepSpread:
        """The spread a serving worker's steps draw from: `spread`, with the typical
        length of the steps it was measured on. A profile that did not record that
        length gets the one its batches' steps had by the model (decode-only steps of
        SERVING_CONTEXT tokens a stream, with what serving adds), each batch counted
        as often as its streams saw a gap: the median of those."""
        spread = self.spread
        if spread.typical_s is not None or not spread.quantiles or not self.samples:
            return spread
        steps = sorted(
            (cost.seconds(StepFeatures(decode_tokens=n, decode_keys=n * SERVING_CONTEXT))
             + self.seconds(n), n)
            for n, _ in self.samples if n > 0
        )  # fmt: skip
        if not steps:
            return spread
        half, seen = sum(n for _, n in steps) / 2, 0
        typical_s = steps[-1][0]
        for seconds, n in steps:
            seen += n
            if seen >= half:
                typical_s = seconds
                break
        return spread.model_copy(update={"typical_s": typical_s}) if typical_s > 0 else spread

    def compute(self, features: StepFeatures, cost: StepCost) -> float:
        """A serving worker's compute of a step: the step-cost model's, by the mixed
        factor where the step carries a prompt's chunk."""
        seconds = cost.seconds(features)
        return seconds * self.mixed_factor if features.prefill_tokens else seconds


# The two steps the contention's workers repeat (`contention.POINT`), as (start,
# tokens) spans: four decodes at 128 tokens of context with a chunk of 128 prompt
# tokens, and the four decodes alone.
_DECODES = ((128, 1),) * 4
CONTENTION_STEPS: tuple[tuple[tuple[int, int], ...], ...] = ((*_DECODES, (0, 128)), _DECODES)


class Contention(_Model):
    """How much longer a step takes while other threads compute on the same cores.

    Demand is busy threads: the step's own worker's, the other workers' stepping
    meanwhile, and the CPU seconds per second the router and the clients spend. A
    step takes `1 + slope * (demand - own) / cores` times its time alone (the slope
    measured with workers stepping together), and never less than the cores shared
    out (`demand / cores`, once they are all taken)."""

    slope: float = Field(default=0.0, ge=0)
    # (workers stepping together, their step time over one worker's alone).
    samples: tuple[tuple[int, float], ...] = ()
    # (workers stepping together, their steps' spread at that level), by level.
    spreads: tuple[tuple[int, StepSpread], ...] = ()
    # (processes busy on the machine, a worker's steps over its steps with it busy
    # alone), measured as a pool runs: the workers stepping while the router relays a
    # load generator's requests and follows their KV feeds. Two bare workers stepping
    # together barely slow each other (the slope above), yet a pool's steps ran 1.2 to
    # 1.9 times the profile's: the router, the client and the feeds take the rest.
    pool: tuple[tuple[int, float], ...] = ()
    # The same for the steps that carry a prompt's chunk, measured in the same phases
    # (the pool's processes slow a chunk's parallel compute more than a decode step's);
    # empty: not measured, such steps take the levels above.
    pool_prompt: tuple[tuple[int, float], ...] = ()
    # The steps that carry a prompt's chunk in the pool phase, their time over the
    # step-cost model's (the median over the rounds): what such a step takes among a
    # pool's processes, measured as one figure. None: not measured.
    pool_prompt_over_model: float | None = Field(default=None, gt=0)

    def stretch(self, demand: float, own: float, cores: int) -> float:
        """A step's time over its time alone, with `demand` busy threads on `cores`
        (its own `own` threads among them)."""
        shared = self.slope * max(0.0, demand - own) / cores
        return max(1.0 + shared, demand / max(cores, own))

    def pool_slowdown(self, processes: int, prompt: bool = False) -> float:
        """A worker's steps' time over its time busy alone, with `processes` busy on
        the machine (its workers, the router and the client): one plus a slowdown per
        process beyond the first, the one closest (least squares) to the measured
        levels, never below none; 1 where none was measured. The levels of steps that
        carry a prompt's chunk (`prompt`) where those were measured, else `pool`'s."""
        levels = self.pool_prompt if prompt and self.pool_prompt else self.pool
        beyond = [(count - 1, slowdown - 1.0) for count, slowdown in levels if count > 1]
        if not beyond:
            return 1.0
        per_process = sum(n * s for n, s in beyond) / sum(n * n for n, _ in beyond)
        return 1.0 + max(0.0, per_process) * max(0, processes - 1)

    def pool_processes(self) -> int:
        """The processes busy in the measured pool phase (1: none measured)."""
        return max((count for count, _ in (*self.pool, *self.pool_prompt)), default=1)

    def spread(self, workers: int) -> StepSpread:
        """The spread of steps with `workers` stepping together: the highest level
        measured up to it. None under two workers: a lone worker's own spread is the
        one its serving measured (`ServingOverhead.spread`)."""
        measured = [spread for level, spread in self.spreads if 2 <= level <= workers]
        return measured[-1] if measured else StepSpread()

    def drawn_spread(self, workers: int, cost: StepCost) -> StepSpread:
        """`spread(workers)` with the typical length of the steps it was measured on;
        where the profile did not record it, the model's mean of the two steps the
        contention's workers repeat (CONTENTION_STEPS)."""
        spread = self.spread(workers)
        if spread.typical_s is not None or not spread.quantiles:
            return spread
        typical_s = sum(cost.seconds(StepFeatures.of_spans(s)) for s in CONTENTION_STEPS) / 2
        return spread.model_copy(update={"typical_s": typical_s}) if typical_s > 0 else spread


class ClientCost(_Model):
    """The CPU the router and the load generator spend on requests (both processes
    together): a fixed time per request and a time per token streamed to it. It takes
    the workers' cores when they run on the same machine."""

    per_request_s: float = Field(default=0.0, ge=0)
    per_token_s: float = Field(default=0.0, ge=0)
    # (requests, tokens streamed, CPU seconds) of each measured run.
    samples: tuple[tuple[int, int, float], ...] = ()


class Spread(_Model):
    """A figure as each round of its measurement gave it. A profile measures in
    rounds, one after another, so that the machine's pace drifting while it runs is
    spread over every figure rather than read as one of them; the figure it keeps is
    taken over the rounds together (medians), and how far the rounds' own values lie
    apart says how far the figure holds on this machine."""

    rounds: tuple[float, ...] = ()

    @property
    def low(self) -> float | None:
        """The least of the rounds' values (None: none measured)."""
        return min(self.rounds, default=None)

    @property
    def high(self) -> float | None:
        """The most of the rounds' values (None: none measured)."""
        return max(self.rounds, default=None)

    def relative(self, value: float) -> float | None:
        """The rounds' range over `value` (the figure kept); None where it is zero or
        there were fewer than two rounds."""
        if len(self.rounds) < 2 or value == 0:
            return None
        return (max(self.rounds) - min(self.rounds)) / abs(value)


# Where a profile's spreads keep each round's pool-phase prompt steps over the model.
POOL_PROMPT_ROUNDS = "contention.pool_phase.pool_prompt_over_model"


class Profile(_Model):
    """A profile file."""

    format: int = PROFILE_FORMAT
    created: str
    model: str  # the directory profiled
    model_json: dict[str, Any]  # its config.json, as the engine reads it
    device: str
    device_name: str
    threads: int = Field(ge=1)  # torch threads of a worker (the sweep ran on as many)
    cores: int | None = Field(default=None, ge=1)  # the machine's; None: not recorded
    versions: dict[str, str]
    engine_args: tuple[str, ...] = ()  # the worker flags the sweep ran under
    step_cost: StepCost
    step_fit: FitError
    steps: tuple[StepSample, ...] = ()
    handoff: HandoffCost = HandoffCost()
    serving: ServingOverhead = ServingOverhead()
    request_overhead_s: float = Field(default=0.0, ge=0)
    # The same with the decode worker already streaming to other clients (its server
    # thread and its steps share the process with the new request's way in and out);
    # None: not measured, the idle figure holds.
    busy_request_overhead_s: float | None = Field(default=None, ge=0)
    startup_s: float | None = Field(default=None, ge=0)
    contention: Contention = Contention()
    clients: ClientCost = ClientCost()
    # Each figure measured in rounds, by its name in the file ("step_cost.base_s",
    # "contention.slope", "request_overhead_s", ...): the value each round gave.
    spreads: dict[str, Spread] = {}

    def prompt_over_model(self) -> float | None:
        """A pool's steps that carry a prompt's chunk over the step-cost model, as the
        pool phase measured them (`Contention.pool_prompt_over_model`; a profile from
        before that field has each round's in its spreads, the median of those);
        None: not measured."""
        if self.contention.pool_prompt_over_model is not None:
            return self.contention.pool_prompt_over_model
        rounds = self.spreads.get(POOL_PROMPT_ROUNDS, Spread()).rounds
        return float(np.median(rounds)) if rounds else None

    def pool_prompt_factor(self, processes: int) -> float:
        """How much longer than a serving worker's compute of it (`ServingOverhead.
        compute`) a step carrying a prompt's chunk runs with `processes` busy on the
        machine. Where the pool phase measured such steps against the model, they run
        at that ratio (over the mixed factor the compute already holds), growing with
        the processes beyond the measured pool's as the prompt levels do: the mixed
        factor is measured with one prompt at a time on a lone worker, apart from the
        pool phase, and the two apart moved 0.83-1.06 between profiles while a pool's
        prompt steps ran 1.1-1.5x the model. Else the prompt levels alone
        (`Contention.pool_slowdown`)."""
        level = self.contention.pool_slowdown(processes, prompt=True)
        ratio = self.prompt_over_model()
        if ratio is None:
            return level
        measured = self.contention.pool_slowdown(self.contention.pool_processes(), prompt=True)
        return ratio / self.serving.mixed_factor * level / measured

    def request_overhead(self, busy: bool) -> float:
        """What a request pays on its way in and its first token on its way out,
        beyond the steps, on a decode worker that is streaming to others (`busy`) or
        not."""
        if busy and self.busy_request_overhead_s is not None:
            return self.busy_request_overhead_s
        return self.request_overhead_s


def load_profile(path: Path) -> Profile:
    """Read a profile file; ProfileError naming the problem."""
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise ProfileError(f"cannot read profile {path}: {error.strerror or error}") from error
    except json.JSONDecodeError as error:
        raise ProfileError(f"{path}: not JSON: {error}") from error
    if isinstance(raw, dict) and raw.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{path}: profile format {raw.get('format')!r}, not {PROFILE_FORMAT}")
    try:
        return Profile.model_validate(raw)
    except ValidationError as error:
        raise ProfileError(f"{path}: {validation_message(error)}") from error


def write_profile(profile: Profile, path: Path) -> None:
    """Write a profile file (indented JSON)."""
    path.write_text(json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")
