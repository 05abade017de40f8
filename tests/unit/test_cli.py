"""The CLI surface: version, help text on every command, JSON envelope, usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer.main

from npusnap_cli import __version__
from npusnap_cli.cli import build_app, main

REPO = Path(__file__).resolve().parents[2]


def all_commands() -> list[tuple[str, click.Command]]:
    """Every leaf command as ("sim start", cmd)."""
    root = typer.main.get_command(build_app())
    found: list[tuple[str, click.Command]] = []

    def walk(prefix: str, cmd: click.Command) -> None:
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(f"{prefix} {name}".strip(), sub)
        else:
            found.append((prefix, cmd))

    walk("", root)
    return found


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"npusnap {__version__}"


def test_console_script_version() -> None:
    exe = Path(sys.executable).parent / "npusnap"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"npusnap {__version__}"


def test_every_command_and_option_has_help() -> None:
    commands = all_commands()
    assert {"check"} <= {name for name, _ in commands}
    for name, cmd in commands:
        assert (cmd.help or "").strip(), f"`npusnap {name}` has no help text"
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert (param.help or "").strip(), f"`npusnap {name}` option {param.opts} has no help"


def test_help_runs_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for name, _ in all_commands():
        assert main([*name.split(), "--help"]) == 0, name
        assert "Usage:" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert "No such command" in capsys.readouterr().err


def test_check_json_envelope(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--json"])
    env = json.loads(capsys.readouterr().out)
    assert env["schema"] == 1 and env["command"] == "check"
    assert env["exit_code"] == code and env["ok"] == (code == 0)
    names = {c["name"] for c in env["result"]["checks"]}
    assert {"criu", "criu-check", "pycriu", "privileges", "ptrace-scope", "cann"} <= names


def test_every_command_has_a_reference_page() -> None:
    for name, _ in all_commands():
        top = name.split()[0]
        page = REPO / "docs" / "reference" / f"{top}.md"
        assert page.is_file(), f"missing docs/reference/{top}.md for `npusnap {name}`"
        assert f"npusnap {name}" in page.read_text(), (
            f"docs/reference/{top}.md does not mention `npusnap {name}`"
        )
