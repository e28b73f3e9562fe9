"""A small map whose entries expire: state about peers that must be remembered for a
while (a failed connection, a finished or cancelled hand-off), never forever, and
never more than a fixed number of entries."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

Key = TypeVar("Key")
Value = TypeVar("Value")


class ExpiringMap(Generic[Key, Value]):
    """Entries live `ttl_s` seconds; past `max_entries`, the oldest go first."""

    def __init__(
        self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not ttl_s > 0 or max_entries <= 0:
            raise ValueError("an expiring map needs a positive lifetime and size")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[Key, tuple[float, Value]] = OrderedDict()

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return self.get(key) is not None

    def put(self, key: Key, value: Value) -> None:
        """Remember `value` for `ttl_s` from now (replacing any older entry)."""
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = (now + self.ttl_s, value)
        self._expire(now)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: Key) -> Value | None:
        """The live value of `key`, or None."""
        self._expire(self._clock())
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def pop(self, key: Key) -> None:
        """Forget `key`."""
        self._entries.pop(key, None)

    def _expire(self, now: float) -> None:
        # Entries are in insertion order and share one lifetime: the oldest expire first.
        while self._entries:
            key, (until, _) = next(iter(self._entries.items()))
            if until > now:
                return
            del self._entries[key]
