"""ServingPool manifests for tests: the checked-in examples, the invalid cases, and
merging a patch into a manifest."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
INVALID_CASES: list[dict[str, Any]] = yaml.safe_load(
    (ROOT / "tests" / "data" / "invalid-servingpools.yaml").read_text()
)


def example(name: str) -> dict[str, Any]:
    """The manifest deploy/examples/NAME.yaml."""
    loaded: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    return loaded


def merged(base: Any, patch: Any) -> Any:
    """`base` with `patch` merged in: maps merge key by key, anything else replaces."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = merged(out.get(key), value)
    return out
