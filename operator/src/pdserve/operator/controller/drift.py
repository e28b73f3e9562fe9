"""Whether a live object still is what the operator last applied (pure).

A server-side apply of unchanged content changes nothing on the server, but it is
still a request; with hundreds of pools, resyncs must not cost one per object. So each
applied object carries a hash of its rendered content, and an object is up to date
when the hash matches (nothing in the spec changed, including removed fields) and the
live object still holds every rendered value (nobody edited it by hand). Fields the
API server adds (defaults, status) are ignored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from pdserve.operator.api import quantity_value

HASH_ANNOTATION = "pdserve.dev/applied-hash"

Obj = dict[str, Any]


def content_hash(obj: Mapping[str, Any]) -> str:
    """A short stable hash of an object's content (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def stamped(obj: Obj) -> Obj:
    """A copy of a rendered object carrying the hash of its content."""
    annotations = {**obj["metadata"].get("annotations", {}), HASH_ANNOTATION: content_hash(obj)}
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


def up_to_date(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether applying a stamped object to `live` would change nothing."""
    want = desired["metadata"].get("annotations", {}).get(HASH_ANNOTATION)
    have = live.get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION)
    return want is not None and want == have and holds(live, desired)


def holds(live: Any, want: Any, *, quantities: bool = False) -> bool:
    """Whether `live` holds every value of `want` (maps: a superset; lists: the same
    length, item by item). Zero values (false, 0, "", empty) match absent ones, as the
    API server omits them; resource quantities match by value ("1" holds 1)."""
    if isinstance(want, Mapping):
        live = {} if live is None else live
        return isinstance(live, Mapping) and all(
            holds(live.get(key), value, quantities=quantities or key == "resources")
            for key, value in want.items()
        )
    if isinstance(want, list):
        live = [] if live is None else live
        return (
            isinstance(live, list)
            and len(live) == len(want)
            and all(
                holds(have, item, quantities=quantities)
                for have, item in zip(live, want, strict=True)
            )
        )
    if live == want and type(live) is type(want):
        return True
    if _zero(want) and _zero(live):
        return True
    return quantities and _same_quantity(live, want)


def _zero(value: Any) -> bool:
    if value is None or value is False or value == "":
        return True
    return type(value) is int and value == 0


def _same_quantity(live: Any, want: Any) -> bool:
    if isinstance(live, bool) or isinstance(want, bool):
        return False
    try:
        return _quantity(live) == _quantity(want)
    except ValueError:
        return False


def _quantity(value: Any) -> Decimal:
    if isinstance(value, int | str):
        return quantity_value(value)
    raise ValueError(value)
