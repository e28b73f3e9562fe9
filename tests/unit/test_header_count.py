"""Whole numbers in the headers pdserve's processes send each other: a peer's word,
checked before use (`protocol.headers.header_count`)."""

from __future__ import annotations

import pytest

from pdserve.protocol.headers import header_count


@pytest.mark.parametrize(("value", "count"), [("0", 0), ("64", 64), ("0064", 64), ("1000", 1000)])
def test_a_whole_number_within_the_bound_is_read(value: str, count: int) -> None:
    assert header_count(value, 1000) == count


@pytest.mark.parametrize(
    "value",
    [None, "", "-1", "+1", " 1", "1 ", "1.0", "1e3", "0x10", "1_000", "\u0661", "\uff11",
     "1001", "9" * 5000],
)  # fmt: skip
def test_anything_else_is_refused_without_converting_it(value: str | None) -> None:
    assert header_count(value, 1000) is None
