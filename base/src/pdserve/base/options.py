"""Command-line options declared once, as a frozen dataclass.

Each field of an options dataclass is one flag: its name gives the flag (`max_num_seqs`
-> `--max-num-seqs`), its default is the flag's default, and `option(...)` adds the
help text, a parser for the value, choices and a group. `add_options` builds the
argparse arguments from the fields and `options_from` turns the parsed namespace back
into the dataclass, so a default is written in exactly one place and `--help` shows it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
Options = TypeVar("Options")

_REQUIRED = dataclasses.MISSING


class OptionError(ValueError):
    """Flags that are each valid but cannot work together; the message names them.
    An options dataclass raises it from `__post_init__`; `pdserve` reports it as a
    usage error."""


def option(
    default: Any = _REQUIRED,
    *,
    help: str,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    exclusive: str | None = None,
    repeat: bool = False,
    short: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag.

    `parse` turns the flag's text into the value (default: the field's own type for
    str/int/float); `group` names the --help section; fields with the same `exclusive`
    key may not be given together; `repeat` makes a list flag given once per value;
    `short` adds a one-letter spelling (`-n`).
    A bool field defaulting to False is a switch (`--no-prefix-caching`).
    """
    metadata = {
        "help": help,
        "parse": parse,
        "choices": tuple(choices) if choices else None,
        "metavar": metavar,
        "group": group,
        "exclusive": exclusive,
        "repeat": repeat,
        "short": short,
    }
    if repeat:
        return dataclasses.field(default_factory=tuple, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def positive_int(text: str) -> int:
    """An integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a timeout of 0 or inf would mean none at all)."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a wait of inf would never end)."""
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 meaning one the system picks at bind time."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str) -> int:
    """`512MiB`, `2G`, `1000000` -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    binary = "I" in unit
    base = unit[:1] if unit not in ("", "B") else unit
    factor = 1024 ** "KMGT".index(base[0]) * 1024 if binary else _UNITS[base]
    return int(number * factor)


def flag_name(field_name: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field_name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, options_type: type[Any]) -> None:
    """Add one argument per field of `options_type` to `parser`."""
    groups: dict[str, argparse._ActionsContainer] = {}
    exclusive: dict[str, argparse._ActionsContainer] = {}
    for field in dataclasses.fields(options_type):
        meta = field.metadata
        if "help" not in meta:
            continue
        container: argparse._ActionsContainer = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = _argument_group(parser, meta["group"])
            container = groups[meta["group"]]
        if meta["exclusive"]:
            key = meta["exclusive"]
            if key not in exclusive:
                exclusive[key] = container.add_mutually_exclusive_group()
            container = exclusive[key]
        flags = [meta["short"]] if meta["short"] else []
        container.add_argument(*flags, flag_name(field.name), dest=field.name, **_argument(field))


def _argument_group(parser: argparse.ArgumentParser, title: str) -> argparse._ActionsContainer:
    """The group of `parser` with this title (options of several dataclasses may share
    a --help section), made if there is none."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _argument(field: dataclasses.Field[Any]) -> dict[str, Any]:
    meta = field.metadata
    required = field.default is _REQUIRED and field.default_factory is _REQUIRED
    default = None if required else field.default
    if field.type in ("bool", bool) and default is False:
        return {"action": "store_true", "help": meta["help"]}
    argument: dict[str, Any] = {"help": _help(meta["help"], default, meta["repeat"])}
    if required:
        argument["required"] = True
    else:
        argument["default"] = [] if meta["repeat"] else default
    if meta["repeat"]:
        argument["action"] = "append"
    parse = meta["parse"] or _PARSERS.get(str(field.type).split(" | ")[0])
    if parse is not None:
        argument["type"] = parse
    if meta["choices"]:
        argument["choices"] = meta["choices"]
    if meta["metavar"]:
        argument["metavar"] = meta["metavar"]
    return argument


def _help(text: str, default: Any, repeat: bool) -> str:
    if repeat or default is None or default is _REQUIRED:
        return text
    shown = default.name if hasattr(default, "name") and not isinstance(default, str) else default
    return f"{text} (default: {shown})".replace("%", "%%")


# Field annotations are strings under `from __future__ import annotations`.
_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def options_from(args: argparse.Namespace, options_type: type[Options]) -> Options:
    """The options dataclass from parsed arguments (fields without a flag keep their
    defaults)."""
    values = {}
    for field in dataclasses.fields(options_type):  # type: ignore[arg-type]
        if field.name in vars(args) and "help" in field.metadata:
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if field.metadata["repeat"] else value
    return options_type(**values)
