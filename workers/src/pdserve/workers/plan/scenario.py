"""A configuration to simulate, as the operator renders it: the pool's routing table
(routing.json, its discovery naming one URL per worker) and each role's `pdserve
worker` arguments. Both are read by the code that reads them in a real pool: the
router's table parser, and the worker's own flags and engine configuration."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.base.options import OptionError, options_from
from pdserve.protocol.api_errors import validation_message
from pdserve.protocol.routing import (
    Role,
    RoutingFileError,
    RoutingTable,
    StaticDiscovery,
    parse_table,
)
from pdserve.workers.bench.metrics import DEFAULT_BUCKETS
from pdserve.workers.engine.config import ConfigError, EngineConfig
from pdserve.workers.plan.hosts import Placement
from pdserve.workers.server import cli as worker_cli
from pdserve.workers.server.options import WorkerOptions
from pdserve.workers.server.worker import engine_config


class ScenarioError(ValueError):
    """A scenario that cannot be simulated; the message names the problem."""


class ScenarioSpec(BaseModel):
    """A scenario as `pdserve simulate` reads it (one JSON object a line)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    routing: dict[str, Any]
    workers: dict[str, list[str]]  # role (prefill, decode) -> `pdserve worker` arguments
    percentiles: tuple[float, ...] = (50.0, 95.0, 99.0)
    # Input-length buckets the figures are given for (as `pdserve bench --json`).
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    # Where the workers run: a node each (a ServingPool's pods), or all on one machine
    # with the router and the clients (`pdserve local`), sharing its cores.
    placement: Placement = "node-per-worker"


@dataclass(frozen=True)
class RoleSetup:
    """How a role's workers run: their engine and the worker settings around it."""

    options: WorkerOptions
    engine: EngineConfig


@dataclass(frozen=True)
class Scenario:
    """A scenario, read as a real pool reads it."""

    name: str
    table: RoutingTable
    discovery: StaticDiscovery
    roles: dict[Role, RoleSetup]
    percentiles: tuple[float, ...]
    buckets: tuple[int, ...]
    placement: Placement = "node-per-worker"

    def urls(self, role: Role) -> tuple[str, ...]:
        """The workers of a role."""
        return self.discovery.prefill if role == "prefill" else self.discovery.decode


def parse_scenario(line: str) -> Scenario:
    """A scenario from its JSON; ScenarioError naming the problem."""
    try:
        spec = ScenarioSpec.model_validate_json(line)
    except ValidationError as error:
        raise ScenarioError(f"scenario: {validation_message(error)}") from error
    try:
        table = parse_table(json.dumps(spec.routing).encode(), f"scenario {spec.name}: routing")
    except RoutingFileError as error:
        raise ScenarioError(str(error)) from error
    if not isinstance(table.discovery, StaticDiscovery):
        raise ScenarioError(f"scenario {spec.name}: discovery must list the workers (static)")
    roles: list[Role] = ["decode", "prefill"] if table.discovery.prefill else ["decode"]
    missing = set(roles) - set(spec.workers)
    if missing:
        raise ScenarioError(f"scenario {spec.name}: no worker arguments for {sorted(missing)}")
    setups = {role: role_setup(spec.name, spec.workers[role]) for role in roles}
    return Scenario(
        spec.name, table, table.discovery, setups, spec.percentiles, spec.buckets,
        spec.placement,
    )  # fmt: skip


def role_setup(name: str, args: list[str]) -> RoleSetup:
    """A role's settings from its `pdserve worker` arguments, parsed by the worker's
    own parser."""
    parser = _Parser(prog="pdserve")
    worker_cli.register(parser.add_subparsers(dest="command", parser_class=_Parser))
    try:
        options = options_from(parser.parse_args(["worker", *args]), WorkerOptions)
        return RoleSetup(options, engine_config(options))
    except (_ArgumentsRefused, OptionError, ConfigError) as error:
        raise ScenarioError(f"scenario {name}: worker arguments: {error}") from error


class _ArgumentsRefused(ValueError):
    """What argparse would have printed before exiting."""


class _Parser(argparse.ArgumentParser):
    """A parser that raises where argparse exits."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentsRefused(message)
