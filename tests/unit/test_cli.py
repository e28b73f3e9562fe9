"""The `pdserve` command: options declared once, and parts that are not installed."""

from __future__ import annotations

import argparse
import importlib.abc
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.cli import main as cli_main
from pdserve.cli.options import add_options, option, options_from, positive_int
from pdserve.workers.server.options import WorkerOptions


@dataclass(frozen=True)
class Example:
    path: Path = option(parse=Path, help="where")
    count: int = option(4, parse=positive_int, help="how many")
    name: str | None = option(None, help="optional")
    quiet: bool = option(False, short="-q", help="say less")
    tags: tuple[str, ...] = option(repeat=True, help="repeatable")
    small: int | None = option(None, exclusive="size", help="small")
    large: int | None = option(None, exclusive="size", help="large")


def parse(*argv: str) -> Example:
    parser = argparse.ArgumentParser()
    add_options(parser, Example)
    return options_from(parser.parse_args(argv), Example)


def test_flags_come_from_the_fields_with_their_defaults() -> None:
    assert parse("--path", "x") == Example(path=Path("x"))
    chosen = parse("--path", "x", "--count", "7", "-q", "--tags", "a", "--tags", "b")
    assert chosen == Example(path=Path("x"), count=7, quiet=True, tags=("a", "b"))


@pytest.mark.parametrize(
    "argv",
    [(), ("--path", "x", "--count", "0"), ("--path", "x", "--small", "1", "--large", "2")],
)
def test_bad_flags_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_hand_off_timeout_must_be_a_finite_positive_number(value: str) -> None:
    parser = argparse.ArgumentParser(prog="worker")
    add_options(parser, WorkerOptions)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--handoff-timeout", value])
    assert (
        options_from(
            parser.parse_args(["--model", "m", "--handoff-timeout", "0.25"]), WorkerOptions
        ).handoff_timeout
        == 0.25
    )


def test_help_shows_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="worker")
    add_options(parser, WorkerOptions)
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS token budget" in text
    assert "(default: 512)" in text and "(default: 64)" in text and "(default: nixl)" in text


class _Uninstalled(importlib.abc.MetaPathFinder):
    """Makes a package look uninstalled, as import itself reports it."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, *_: object) -> None:
        if fullname == self.package:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def test_a_part_that_is_not_installed_names_its_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(sys.modules):
        if name.startswith("pdserve.operator"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Uninstalled("pdserve.operator"), *sys.meta_path])
    assert cli_main.main(["operator", "-A"]) == 2
    assert "needs the pdserve-operator package" in capsys.readouterr().err
