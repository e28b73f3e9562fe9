"""The decode worker's HTTP calls to a prefill worker: JSON out, a bounded JSON answer
back, within a deadline. What the peer says is data to check, never to trust: its
answer is read up to a size limit, its error code is mapped onto the known codes and
its error message is cut short."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.workers.handoff.errors import HandoffError, known_code

MAX_REPLY_BYTES = 1024 * 1024
MAX_MESSAGE_CHARS = 300


class NoReply(Exception):
    """The peer did not answer: the deadline passed, or the connection failed."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Reply:
    """An answer: its status and its JSON body (None when it was not JSON)."""

    url: str
    status: int
    body: Any

    @property
    def ok(self) -> bool:
        """Whether the status is 200."""
        return self.status == 200

    def error(self) -> HandoffError:
        """The failure this (non-200) answer reports, in known codes."""
        raw = self.body.get("error") if isinstance(self.body, dict) else None
        error = raw if isinstance(raw, dict) else {}
        message = error.get("message")
        text = message[:MAX_MESSAGE_CHARS] if isinstance(message, str) else f"HTTP {self.status}"
        return HandoffError(f"{self.url}: {text}", known_code(error.get("code")))


async def post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], deadline: float
) -> Reply:
    """POST `body` to `url` and read the answer by `deadline` (time.monotonic()).
    NoReply when there is none in time, or no time was left to begin with."""
    return await _call(session, "POST", url, body, deadline)


async def get_json(session: aiohttp.ClientSession, url: str, deadline: float) -> Reply:
    """GET `url` and read the answer by `deadline`; NoReply as `post_json`."""
    return await _call(session, "GET", url, None, deadline)


async def _call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: dict[str, Any] | None,
    deadline: float,
) -> Reply:
    left = deadline - time.monotonic()
    if left <= 0:  # aiohttp reads a timeout of 0 as "none"
        raise NoReply(f"{url}: no time left to ask", timed_out=True)
    try:
        timeout = aiohttp.ClientTimeout(total=left)
        async with session.request(method, url, json=body, timeout=timeout) as response:
            raw = await response.content.read(MAX_REPLY_BYTES + 1)
            status = response.status
    except TimeoutError as error:
        raise NoReply(f"{url} did not answer within {left:.1f}s", timed_out=True) from error
    except aiohttp.ClientError as error:
        raise NoReply(f"{url} failed: {error}", timed_out=False) from error
    if len(raw) > MAX_REPLY_BYTES:
        return Reply(url, status, None)
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past any sense
        parsed = None
    return Reply(url, status, parsed)
