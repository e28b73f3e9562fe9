"""The wire format of a worker's KV event feed (`/pd/kv/*`), shared by the worker that
serves it and the router that reads it. Everything the router reads is validated
here: hashes are 32 hex digits, counts and lengths are bounded.

  GET /pd/kv/snapshot -> KVSnapshotBody: the worker's identity (what the router's
      handshake compares) and every block hash its prefix cache holds, as of event
      `seq` of `epoch`.
  GET /pd/kv/stream?epoch=E&after=N -> one long-lived answer of newline-delimited
      KVEventsBody lines (`application/x-ndjson`): the first at once (the events after
      number N, or none), then one for each step that changed the cache (at most
      MAX_LINE_EVENTS events a line; more are split), and an empty one every
      HEARTBEAT_S while nothing changes. A line with `gap` (the subscriber's events
      are no longer all kept, or its epoch is not the worker's) is the stream's last:
      read a snapshot. The worker also ends it when it stops.
  GET /pd/kv/events?epoch=E&after=N&wait_ms=W -> KVEventsBody: the events after
      number N (waiting up to W ms for one), or `gap`: read a snapshot. One request per
      change: for subscribers that poll (the router streams).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

FEED_PREFIX = "/pd/kv/"
SNAPSHOT_PATH = FEED_PREFIX + "snapshot"
EVENTS_PATH = FEED_PREFIX + "events"
STREAM_PATH = FEED_PREFIX + "stream"
STREAM_CONTENT_TYPE = "application/x-ndjson"
# How often a stream says it lives while the cache does not change; a subscriber
# that hears nothing for a few of these drops the connection and reconnects.
HEARTBEAT_S = 5.0
# Most events one stream line carries, so a line stays under MAX_LINE_BYTES even when
# a subscriber catches up on many steps at once (an event folds up to 64 hashes).
MAX_LINE_EVENTS = 128
MAX_LINE_BYTES = 1 << 20
# The longest a worker holds an events request open waiting for an event.
MAX_WAIT_MS = 10_000
# Most hashes one answer may carry (a worker's whole cache, in a snapshot).
MAX_HASHES = 4_000_000

HexHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class KVIdentity(_Wire):
    """What must match for a router's hashes to name a worker's blocks."""

    block_size: int = Field(ge=1, le=1 << 16)
    hash_function: str = Field(min_length=1, max_length=128)
    hash_seed: str = Field(max_length=128)
    model: str = Field(min_length=1, max_length=1024)
    weights: str = Field(max_length=128)  # a digest of the checkpoint ("" if unknown)
    num_blocks: int = Field(ge=1, le=1 << 32)  # the most blocks the cache can hold


class KVSnapshotBody(_Wire):
    """The body of GET /pd/kv/snapshot."""

    identity: KVIdentity
    epoch: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    hashes: list[HexHash] = Field(max_length=MAX_HASHES)


class KVEventBody(_Wire):
    """One event: blocks stored or removed (their hashes), or all cleared. An event
    of n hashes stands for numbers seq - n + 1 .. seq; a clear for seq alone."""

    seq: int = Field(ge=1)
    kind: Literal["stored", "removed", "cleared"]
    hashes: list[HexHash] = Field(default_factory=list, max_length=MAX_HASHES)


class KVEventsBody(_Wire):
    """The body of GET /pd/kv/events."""

    epoch: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)  # the worker's last event number now
    events: list[KVEventBody] = Field(default_factory=list)
    gap: bool = False  # the events asked for are no longer all kept: read a snapshot
