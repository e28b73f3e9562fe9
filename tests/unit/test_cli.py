"""The `pdserve` command: options declared once, parts that are not installed, and a
port another process holds."""

from __future__ import annotations

import argparse
import importlib.abc
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.base.options import add_options, option, options_from, positive_int
from pdserve.base.ports import PortInUseError, binding, check_port_free
from pdserve.cli import main as cli_main
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


@pytest.mark.parametrize("flag", ["--handoff-room-wait", "--drain-timeout"])
@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "inf", "1e400", "soon"])
def test_a_wait_must_be_a_finite_number_of_seconds_zero_or_more(flag: str, value: str) -> None:
    parser = argparse.ArgumentParser(prog="worker")
    add_options(parser, WorkerOptions)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", flag, value])
    for fine in ("0", "2.5e-3"):
        chosen = options_from(parser.parse_args(["--model", "m", flag, fine]), WorkerOptions)
        assert getattr(chosen, flag.removeprefix("--").replace("-", "_")) == float(fine)


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


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--token-budget", "adaptive", "--target-itl-ms", "0"), "--target-itl-ms"),
        (("--token-budget", "adaptive", "--target-itl-ms", "-5"), "--target-itl-ms"),
        (("--token-budget", "adaptive"), "--target-itl-ms"),
        (
            ("--token-budget", "adaptive", "--target-itl-ms", "50", "--min-budget", "512",
             "--max-budget", "128"),
            "--min-budget (512) must not exceed --max-budget (128)",
        ),
        (
            ("--token-budget", "adaptive", "--target-itl-ms", "50", "--min-budget", "1024"),
            "--min-budget (1024) must not exceed the ceiling, --max-budget (default: "
            "--max-num-batched-tokens, 512)",
        ),
        (("--min-budget", "64", "--max-budget", "32"), "--min-budget (64) must not exceed"),
        (
            ("--token-budget", "adaptive", "--target-itl-ms", "50", "--no-chunked-prefill"),
            "--no-chunked-prefill",
        ),
    ],
)  # fmt: skip
def test_worker_refuses_a_bad_token_budget_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    # Refused before anything is loaded (the model directory does not even exist).
    argv = ["worker", "--model", str(tmp_path / "absent"), *flags]
    with pytest.raises(SystemExit) as exited:
        sys.exit(cli_main.main(argv))
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_worker_token_budget_flags_reach_the_engine(tmp_path: Path) -> None:
    from pdserve.workers.server.worker import engine_config

    parser = argparse.ArgumentParser()
    add_options(parser, WorkerOptions)
    argv = ["--model", str(tmp_path), "--token-budget", "adaptive", "--target-itl-ms", "40"]
    options = options_from(parser.parse_args([*argv, "--max-budget", "1024"]), WorkerOptions)
    budget = engine_config(options).scheduler.token_budget
    assert (budget.mode, budget.target_itl_s, budget.min_budget, budget.max_budget) == (
        "adaptive", 0.04, 32, 1024,
    )  # fmt: skip
    static = options_from(parser.parse_args(["--model", str(tmp_path)]), WorkerOptions)
    assert engine_config(static).scheduler.token_budget.mode == "static"


def test_a_port_taken_at_bind_is_named_with_its_flag() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(PortInUseError) as taken, binding("127.0.0.1", port, "--metrics-port"):
            socket.create_server(("127.0.0.1", port))
        assert str(taken.value) == (
            f"port {port} on 127.0.0.1 is already in use: choose another with --metrics-port"
        )
        with pytest.raises(PortInUseError):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again
    check_port_free("127.0.0.1", 0)
    with pytest.raises(PermissionError), binding("127.0.0.1", 1):
        raise PermissionError("not this")
