"""The routing table: routing.json, the file the operator renders into the pool's
ConfigMap, or the local pool writes, and the router reads. These models are its one
schema (published as docs/routing.schema.json: `python -m pdserve.protocol.routing`).
It is validated whole: a malformed file is refused with a message naming the problem,
at start-up and when it is re-read after a change (the table in force then stays).

A prompt takes the first bucket whose `maxInputTokens` holds it; the bucket says
whether it is served colocated (a decode worker prefills it) or disaggregated (a
prefill worker prefills it and hands its KV cache to a decode worker).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pdserve.protocol.api_errors import validation_message
from pdserve.protocol.internal import parse_worker_url

Mode = Literal["colocated", "disaggregated"]
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class RoutingFileError(ValueError):
    """A routing file that cannot be used; the message names the problem."""


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid"
    )


class Bucket(_Model):
    """Prompts of at most `max_input_tokens` tokens (None: any length) take `mode`."""

    max_input_tokens: int | None = Field(default=None, ge=1)
    mode: Mode


class ModelRef(_Model):
    """The served model: its API name and the directory its tokenizer is read from."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    max_model_len: int | None = Field(default=None, ge=1)


class KvTransfer(_Model):
    """What a decode worker does when a hand-off fails (informational for the router)."""

    failure_policy: Literal["recompute", "fail"] = "recompute"


class RoutingPolicy(_Model):
    """How the router picks a worker. `load`: the least loaded. `kv-aware`: the one
    with the least predicted time to first token: its prompt tokens not in its prefix
    cache (from the router's index of the workers' KV events, hashed in blocks of
    `block_size` from `hash_seed`, which must be the workers' own) after the prompt
    tokens waiting in it, at what its steps cost as it publishes them, plus what the
    requests it decodes add to those steps; ties go to the less loaded. With
    `load_weight_tokens` set, the cost is counted in tokens instead: uncached and
    waiting prompt tokens plus that weight per request it holds. A KV-aware router
    also decides colocated or disaggregated on the tokens the chosen decode worker
    lacks."""

    type: Literal["kv-aware", "load"] = "kv-aware"
    block_size: int = Field(default=16, ge=1, le=1024)
    hash_seed: str = Field(default="", max_length=256)
    load_weight_tokens: int | None = Field(default=None, ge=0, le=1 << 20)


class RevisionWeight(_Model):
    """A revision of a role's workers and its share of the role's requests (percent)."""

    name: str = Field(min_length=1, max_length=63)
    weight: int = Field(ge=0, le=100)


class Revisions(_Model):
    """Traffic by revision during a rollout, per role: a worker says its revision (its
    `--revision`); a role with no list here splits nothing. A worker whose revision a
    role's list does not name gets none of its requests."""

    prefill: tuple[RevisionWeight, ...] = Field(default=(), max_length=4)
    decode: tuple[RevisionWeight, ...] = Field(default=(), max_length=4)

    @field_validator("prefill", "decode")
    @classmethod
    def _split(cls, weights: tuple[RevisionWeight, ...]) -> tuple[RevisionWeight, ...]:
        if weights and sum(w.weight for w in weights) != 100:
            raise ValueError("the revisions' weights must add up to 100")
        if len({w.name for w in weights}) != len(weights):
            raise ValueError("a revision is named twice")
        return weights

    def of(self, role: Role) -> tuple[RevisionWeight, ...]:
        """A role's split (empty: none)."""
        return self.prefill if role == "prefill" else self.decode


class Slo(_Model):
    """The pool's latency targets: goodput counts the requests that meet them."""

    ttft_seconds: float | None = Field(default=None, gt=0)
    itl_seconds: float | None = Field(default=None, gt=0)


class StaticDiscovery(_Model):
    """Workers at fixed URLs (the local pool)."""

    kind: Literal["static"]
    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()

    @field_validator("decode", "prefill")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(parse_worker_url(url).url for url in urls)

    def has_prefill(self) -> bool:
        """Whether any prefill worker is named."""
        return bool(self.prefill)


class Services(_Model):
    """The pool's headless Services, one per role."""

    decode: str = Field(min_length=1, max_length=63)
    prefill: str | None = Field(default=None, min_length=1, max_length=63)


class KubernetesDiscovery(_Model):
    """Workers found from the EndpointSlices of the pool's Services."""

    kind: Literal["kubernetes"]
    namespace: str = Field(min_length=1, max_length=63)
    port: int = Field(ge=1, le=65535)
    services: Services

    def has_prefill(self) -> bool:
        """Whether the pool has a prefill Service."""
        return self.services.prefill is not None


Discovery = Annotated[StaticDiscovery | KubernetesDiscovery, Field(discriminator="kind")]


class RoutingTable(_Model):
    """routing.json, validated."""

    pool: str = Field(min_length=1)
    model: ModelRef
    buckets: tuple[Bucket, ...] = Field(min_length=1)
    kv_transfer: KvTransfer = KvTransfer()
    routing_policy: RoutingPolicy = RoutingPolicy()
    discovery: Discovery
    slo: Slo = Slo()
    revisions: Revisions = Revisions()

    @field_validator("buckets")
    @classmethod
    def _ordered(cls, buckets: tuple[Bucket, ...]) -> tuple[Bucket, ...]:
        if any(b.max_input_tokens is None for b in buckets[:-1]):
            raise ValueError("only the last bucket may omit maxInputTokens")
        bounds = [b.max_input_tokens for b in buckets if b.max_input_tokens is not None]
        if any(low >= high for low, high in itertools.pairwise(bounds)):
            raise ValueError("maxInputTokens must be strictly ascending")
        return buckets

    @model_validator(mode="after")
    def _prefill_for_disaggregation(self) -> RoutingTable:
        if (
            any(b.mode == "disaggregated" for b in self.buckets)
            and not self.discovery.has_prefill()
        ):
            raise ValueError(
                "buckets: a disaggregated bucket needs prefill workers in discovery "
                "(discovery.prefill or discovery.services.prefill)"
            )
        return self

    def bucket_of(self, prompt_tokens: int) -> int:
        """The index of the bucket a prompt of `prompt_tokens` tokens takes (the last
        one when no bound holds it)."""
        for index, bucket in enumerate(self.buckets):
            if bucket.max_input_tokens is None or prompt_tokens <= bucket.max_input_tokens:
                return index
        return len(self.buckets) - 1

    def colocated_up_to(self) -> int:
        """The most prompt tokens the table serves colocated before its first
        disaggregated bucket (0 when that is the first)."""
        bound = 0
        for bucket in self.buckets:
            if bucket.mode == "disaggregated" or bucket.max_input_tokens is None:
                break
            bound = bucket.max_input_tokens
        return bound

    def bucket_label(self, index: int) -> str:
        """A bucket's metric label: `le512`, `gt512` (the unbounded last), `all`."""
        bound = self.buckets[index].max_input_tokens
        if bound is not None:
            return f"le{bound}"
        if index == 0:
            return "all"
        return f"gt{self.buckets[index - 1].max_input_tokens}"


def parse_table(data: bytes, source: str = "routing.json") -> RoutingTable:
    """A routing table from the file's bytes; RoutingFileError naming the problem."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RoutingFileError(f"{source}: not JSON: {error}") from error
    if not isinstance(raw, dict):
        raise RoutingFileError(f"{source}: must hold a JSON object")
    try:
        return RoutingTable.model_validate(raw, by_name=False)
    except ValidationError as error:
        raise RoutingFileError(f"{source}: {validation_message(error)}") from error


def read_table(path: Path) -> tuple[bytes, RoutingTable]:
    """The file's bytes and the table they hold; RoutingFileError if either fails."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RoutingFileError(f"cannot read {path}: {error.strerror or error}") from error
    return data, parse_table(data, str(path))


def dump_table(table: RoutingTable) -> str:
    """routing.json's text: the fields that were given (a null given stays null), keys in
    a stable order, so the same table is always the same bytes (the router's Deployment
    rolls when they change)."""
    data = table.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def json_schema() -> str:
    """The JSON schema of routing.json, as published."""
    schema = RoutingTable.model_json_schema(by_alias=True)
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(json_schema(), end="")
