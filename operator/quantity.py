"""Kubernetes resource quantities ("4Gi", "1500M", "2e9") as plain numbers."""

from __future__ import annotations

import math
import re
from decimal import Decimal

_SUFFIXES = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(
    r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[numkMGTPE]|)$"
)
_EXPONENT = re.compile(
    r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)[eE](?P<exp>[+-]?[0-9]+(\.[0-9]*)?)$"
)


def parse_quantity(quantity: int | str) -> Decimal:
    """The value of a quantity; raises ValueError when it is not one."""
    if isinstance(quantity, int):
        return Decimal(quantity)
    if match := _QUANTITY.match(quantity):
        return Decimal(match["number"]) * _SUFFIXES[match["suffix"]]
    if match := _EXPONENT.match(quantity):
        return Decimal(match["number"]) * Decimal(10) ** Decimal(match["exp"])
    raise ValueError(f"not a Kubernetes quantity: {quantity!r}")


def to_bytes(quantity: int | str) -> int:
    """A memory quantity in whole bytes (rounded up, as Kubernetes does)."""
    return math.ceil(parse_quantity(quantity))
