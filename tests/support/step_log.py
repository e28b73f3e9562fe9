"""A worker's steps as its DEBUG step logs tell them (`pdserve.workers.engine.steps`:
the chunks a step ran; `pdserve.workers.engine.step_timing`: what it took), and what
they did to the requests decoding in them: every decoding request waits for its step,
so a step that also ran a prompt's chunk is a long gap in each of their streams."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.workers.plan.step_log import chunks_of, is_warm_up, took_ms_of


@dataclass(frozen=True)
class Step:
    """One step: the requests it decoded, the prompt tokens it computed and how deep
    into their prompts (the last position of its deepest chunk), and its duration."""

    decodes: int
    prompt_tokens: int
    depth: int
    took_ms: float


def read_steps(log: Path) -> list[Step]:
    """The steps a worker's log tells (warm-up steps left out)."""
    steps: list[Step] = []
    chunks: list[tuple[str, int, int]] | None = None
    for line in log.read_text(errors="replace").splitlines():
        if (listed := chunks_of(line)) is not None:
            chunks = listed
        elif (took_ms := took_ms_of(line)) is not None and chunks is not None:
            if not is_warm_up(chunks):
                steps.append(_step(chunks, took_ms))
            chunks = None
    return steps


def _step(chunks: list[tuple[str, int, int]], took_ms: float) -> Step:
    # A decode computes one token past its prompt; a prompt's chunk computes more (a
    # one-token prompt chunk counts as a decode: it waits the same).
    prompt = [(start, tokens) for _, start, tokens in chunks if tokens > 1]
    return Step(
        decodes=len(chunks) - len(prompt),
        prompt_tokens=sum(tokens for _, tokens in prompt),
        depth=max((start + tokens for start, tokens in prompt), default=0),
        took_ms=took_ms,
    )


def decode_step_figures(steps: Iterable[Step]) -> dict[str, float | None]:
    """What decoding requests waited for, per token decoded: the share of decode tokens
    whose step also ran a prompt's chunk, the P99 of their steps' durations (the
    engine's own part of ITL P99), and the mean depth of the chunks beside them."""
    waits, beside, depths = [], [], []
    for step in steps:
        waits += [step.took_ms] * step.decodes
        if step.prompt_tokens:
            beside += [step.took_ms] * step.decodes
            depths += [step.depth] * step.decodes
    if not waits:
        return {"decode_tokens_beside_prompt": None, "decode_step_p99_ms": None,
                "depth_beside_decodes": None}  # fmt: skip
    return {
        "decode_tokens_beside_prompt": len(beside) / len(waits),
        "decode_step_p99_ms": float(np.percentile(waits, 99)),
        "depth_beside_decodes": float(np.mean(depths)) if depths else 0.0,
    }


STEP_LOGGING = Path(__file__).resolve().parent / "step_logging"


def step_logging_env() -> dict[str, str]:
    """The environment that turns a worker's per-step logs on (and only those)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(STEP_LOGGING) + (os.pathsep + path if path else "")}
