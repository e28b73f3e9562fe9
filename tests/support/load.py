"""Closed-loop load for tests: clients that each send a streamed completion, wait
for its end, and send the next, until stopped; every outcome is counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import openai


@dataclass
class Outcomes:
    """What the clients saw."""

    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.ok += 1
            else:
                self.failed += 1
                self.errors.append(error)


class Load:
    """`clients` closed-loop clients of `url`, each sending `prompt` for `max_tokens`."""

    def __init__(
        self, url: str, model: str, *, clients: int, prompt: str | Sequence[int], max_tokens: int
    ) -> None:
        self.url = url
        self.model = model
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.outcomes = Outcomes()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Outcomes:
        """Stop sending; wait for the requests in flight; what they saw."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self.outcomes

    def _client(self) -> None:
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120.0
        )
        while not self._stop.is_set():
            self.outcomes.record(self._one(client))

    def _one(self, client: openai.OpenAI) -> str | None:
        try:
            stream = client.completions.create(
                model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            finish = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        except openai.OpenAIError as error:
            time.sleep(0.1)  # a refused request must not spin
            return f"{type(error).__name__}: {error}"
        return None if finish == "length" else f"ended with finish_reason {finish}"


@contextmanager
def load(
    url: str, model: str, *, clients: int, prompt: str | Sequence[int], max_tokens: int
) -> Iterator[Load]:
    """Closed-loop load for the duration of a `with` block."""
    running = Load(url, model, clients=clients, prompt=prompt, max_tokens=max_tokens).start()
    try:
        yield running
    finally:
        running.stop()
