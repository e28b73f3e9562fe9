"""Trace replay: parsing the real Azure trace, scaling and cutting it."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.plan import build_plan
from pdserve.workers.bench.trace import TraceError, TraceScaling, load_trace, scale_trace

REPO = Path(__file__).resolve().parents[2]
AZURE_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"

needs_trace = pytest.mark.skipif(not AZURE_TRACE.exists(), reason=f"{AZURE_TRACE} not present")


@needs_trace
def test_azure_trace_parses_with_offsets_from_the_first_request() -> None:
    rows = load_trace(AZURE_TRACE)
    assert len(rows) == 19_366
    assert rows[0].offset_s == 0.0
    assert all(a.offset_s <= b.offset_s for a, b in pairwise(rows))
    # One hour of traffic; the first request is 2023-11-16 18:15:46.6805900, 374 in, 44 out.
    assert 3000 < rows[-1].offset_s < 3600
    assert (rows[0].context_tokens, rows[0].generated_tokens) == (374, 44)
    # The second request arrived 4.3145790 s later (the trace has 100 ns resolution).
    assert rows[1].offset_s == pytest.approx(4.314579, abs=1e-6)
    contexts = sorted(r.context_tokens for r in rows)
    assert 900 < contexts[len(contexts) // 2] < 1100  # the README's p50 of about 1020


@needs_trace
def test_scaling_and_cutting_the_azure_trace() -> None:
    rows = load_trace(AZURE_TRACE)
    scaling = TraceScaling(
        time_scale=0.1,
        length_scale=0.5,
        max_input_tokens=512,
        max_output_tokens=64,
        duration_s=30.0,
    )
    replay = scale_trace(rows, scaling)
    expected = [r for r in rows if r.offset_s * 0.1 < 30.0]
    assert len(replay) == len(expected) > 100
    assert replay[1].offset_s == pytest.approx(0.4314579)
    assert (replay[0].context_tokens, replay[0].generated_tokens) == (187, 22)
    assert max(r.context_tokens for r in replay) == 512
    assert max(r.generated_tokens for r in replay) == 64
    assert min(r.context_tokens for r in replay) >= 1
    by_count = scale_trace(rows, TraceScaling(num_requests=10))
    assert len(by_count) == 10


@needs_trace
def test_trace_plan_follows_the_trace() -> None:
    config = BenchConfig(
        url="http://127.0.0.1:1", trace=AZURE_TRACE, num_requests=20, trace_length_scale=0.25
    )
    plan = build_plan(config)
    rows = load_trace(AZURE_TRACE)[:20]
    assert [p.offset_s for p in plan] == [r.offset_s for r in rows]
    assert [p.input_tokens for p in plan] == [max(1, round(r.context_tokens / 4)) for r in rows]
    assert {p.kind for p in plan} == {"trace"}


def test_unsorted_trace_is_sorted(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:02.5,30,3\n"
        "2023-11-16 18:00:01.0,10,1\n"
    )
    rows = load_trace(path)
    assert [(r.offset_s, r.context_tokens) for r in rows] == [(0.0, 10), (1.5, 30)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:01,1\n", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "t.csv:2: bad row"),
    ],
)
def test_bad_traces_get_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "absent.csv")
