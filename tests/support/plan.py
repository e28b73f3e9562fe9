"""Profiles and scenarios for simulator tests, written as `pdserve profile` and the
operator's `pdserve plan` write them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.workers.plan.costs import FitError, HandoffCost, Profile, StepCost

# Step costs of the order a small model has on a CPU: a fixed cost, per-token costs,
# and attention that grows with the keys a chunk reads.
CPU_LIKE = StepCost(
    base_s=0.004,
    per_decode_token_s=2e-5,
    per_prefill_token_s=4e-5,
    per_decode_key_s=1e-8,
    per_prefill_key_s=4e-9,
)


def model_config_dir(directory: Path) -> Path:
    """`directory` holding a small model's config.json: all the simulator reads of a
    model."""
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 2048, "torch_dtype": "float32",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def constant_profile(model_dir: Path, step_s: float, handoff_s: float = 0.0) -> Profile:
    """A profile in which every step takes `step_s` and a hand-off `handoff_s`."""
    zero = {"per_decode_token_s": 0.0, "per_prefill_token_s": 0.0}
    cost = StepCost(base_s=step_s, per_decode_key_s=0.0, per_prefill_key_s=0.0, **zero)
    return profile_with(model_dir, cost, HandoffCost(fixed_s=handoff_s))


def profile_with(model_dir: Path, cost: StepCost, handoff: HandoffCost | None = None) -> Profile:
    """A profile of the model in `model_dir` with these costs."""
    return Profile(
        created="2026-01-01T00:00:00Z",
        model=str(model_dir),
        model_json=json.loads((model_dir / "config.json").read_text()),
        device="cpu",
        device_name="test",
        threads=1,
        versions={},
        step_cost=cost,
        step_fit=FitError(samples=0, mean_abs=0.0, p90_abs=0.0, max_abs=0.0),
        handoff=handoff or HandoffCost(),
    )


def azure_trace(path: Path, rows: Sequence[tuple[float, int, int]]) -> Path:
    """A trace in the Azure CSV format: (offset in seconds, prompt, output) per row."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for offset, prompt, output in rows:
        seconds = 10.0 + offset
        lines.append(
            f"2023-11-16 18:{int(seconds // 60):02d}:{seconds % 60:09.6f},{prompt},{output}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def scenario_line(
    name: str,
    decode_args: Sequence[str],
    prefill_args: Sequence[str] = (),
    num_decode: int = 1,
    num_prefill: int = 0,
    buckets: Sequence[dict[str, Any]] = ({"mode": "colocated"},),
    slo: dict[str, float] | None = None,
    placement: str = "node-per-worker",
) -> str:
    """A scenario as `pdserve simulate` reads it."""
    routing = {
        "pool": "sim",
        "model": {"name": "sim", "path": "/models/sim"},
        "buckets": list(buckets),
        "discovery": {
            "kind": "static",
            "decode": [f"http://decode-{i}.sim:8000" for i in range(num_decode)],
            "prefill": [f"http://prefill-{i}.sim:8000" for i in range(num_prefill)],
        },
        "slo": slo or {},
    }
    workers = {"decode": ["--model", "/models/sim", *decode_args]}
    if num_prefill:
        workers["prefill"] = ["--model", "/models/sim", "--role", "prefill", *prefill_args]
    scenario = {"name": name, "routing": routing, "workers": workers, "placement": placement}
    return json.dumps(scenario)
