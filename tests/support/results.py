"""Benchmark results: a JSON file under out/bench/ and a table on stdout."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("out/bench")


def publish(name: str, rows: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] = {}) -> Path:
    """Write `rows` (one dict per table row) and `extra` to out/bench/NAME.json and
    print them as a table."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"rows": list(rows), **extra}, indent=2, default=str))
    print(f"\n{name}")
    print(format_table(rows))
    for key, value in extra.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")
    return path


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain aligned text table."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
