"""The CLI surface: version, help text on every command, JSON envelope, usage errors."""

from __future__ import annotations

import json
import re
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
    """Every leaf command as ("sim start", cmd), through the groups' own lookup (the top-level
    group imports a command's module only when asked for it)."""
    root = typer.main.get_command(build_app())
    found: list[tuple[str, click.Command]] = []

    def walk(prefix: str, cmd: click.Command, ctx: click.Context) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, name
                walk(f"{prefix} {name}".strip(), sub, click.Context(sub, parent=ctx, info_name=name))
        else:
            found.append((prefix, cmd))

    walk("", root, click.Context(root, info_name="npusnap"))
    return found


def test_the_command_table_summaries_are_the_commands_own() -> None:
    """`npusnap --help` lists the table's summaries without importing the commands: each is its
    command's first sentence, as click would show it from the command itself."""
    from npusnap_cli.cli import COMMANDS

    root = typer.main.get_command(build_app())
    assert isinstance(root, click.Group)
    ctx = click.Context(root, info_name="npusnap")
    for name, (_module, summary) in COMMANDS.items():
        cmd = root.get_command(ctx, name)
        assert cmd is not None, name
        assert click.Command(name, help=summary).get_short_help_str(10_000) == cmd.get_short_help_str(
            10_000
        ), name


def test_help_imports_no_command_module() -> None:
    """`npusnap --help` lists every command without importing any command's module, nor the
    simulator's or the workloads' packages (whose commands the table names by dotted path)."""
    code = (
        "import sys; from npusnap_cli.cli import main; main(['--help']); "
        "print(sorted(m for m in sys.modules "
        "if m.startswith(('npusnap_cli.commands.', 'npusnap_sim', 'npusnap_workloads')) "
        "and not m.endswith('_common')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


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


def _opts(cmd: click.Command) -> set[str]:
    root = typer.main.get_command(build_app())
    found = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    return found | {o for p in root.params for o in (*p.opts, *p.secondary_opts)}


def test_every_command_help_ends_with_examples_that_parse() -> None:
    """Each --help shows examples (typer epilog); their options exist on that command."""
    import shlex

    for name, cmd in all_commands():
        assert cmd.epilog and "Examples:" in cmd.epilog, f"`npusnap {name}` --help has no examples"
        lines = [line.strip() for line in cmd.epilog.splitlines()[2:] if line.strip()]
        assert any(f"npusnap {name}" in line for line in lines), name
        for line in lines:
            lexer = shlex.shlex(line.split(" #", 1)[0], posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            segments: list[list[str]] = [[]]
            for token in lexer:
                if set(token) <= set("();<>|&"):
                    segments.append([])
                else:
                    segments[-1].append(token.lstrip("$"))
            for words in segments:
                if words[:1] != ["npusnap"] or " ".join(words[1 : 1 + len(name.split())]) != name:
                    continue
                for word in words[1:]:
                    if word == "--":
                        break  # a program's own command line follows
                    if word.startswith("-") and not re.fullmatch(r"-v+", word):
                        assert word.split("=")[0] in _opts(cmd), f"`npusnap {name}` example: {word} ({line})"


def test_short_flags_follow_podman() -> None:
    commands = dict(all_commands())
    assert {"-R", "--leave-running", "-e", "--export"} <= _opts(commands["dump"])
    assert {"-i", "--import", "--dry-run"} <= _opts(commands["restore"])
    assert {"-q", "--quiet", "-v", "--verbose"} <= _opts(commands["check"])


def test_timeouts_are_seconds_as_floats_everywhere() -> None:
    for name, cmd in all_commands():
        for p in cmd.params:
            if "--timeout" in getattr(p, "opts", ()):
                assert isinstance(p.type, (click.types.FloatParamType, click.types.FloatRange)), (
                    f"`npusnap {name} --timeout` is {p.type}"
                )


def test_directory_arguments_are_called_dir() -> None:
    for name, cmd in all_commands():
        for p in cmd.params:
            if isinstance(p, click.Argument):
                shown = p.metavar if p.metavar is not None else (p.name or "").upper()
                assert "DIRECTORY" not in shown, f"`npusnap {name}`: say DIR, as every page does"


def test_verbose_and_quiet_anywhere() -> None:
    from npusnap_cli.commands._common import hoist_global_flags

    assert hoist_global_flags(["dump", "-vv", "1", "d"]) == ["-vv", "dump", "1", "d"]
    assert hoist_global_flags(["restore", "d", "-q"]) == ["-q", "restore", "d"]
    # Never from a program's own command line.
    assert hoist_global_flags(["run", "-d", "--", "prog", "-v"]) == ["run", "-d", "--", "prog", "-v"]
    assert hoist_global_flags(["run", "prog", "-v"]) == ["run", "prog", "-v"]
    assert hoist_global_flags(["run", "-v", "prog"]) == ["-v", "run", "prog"]


def test_json_envelope_carries_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    from npusnap_cli.ui import Output

    out = Output("x", json_mode=True)
    out.warn("fd 3 is a pipe shared with pid 1 outside the tree")
    out.result({"a": 1})
    env = json.loads(capsys.readouterr().out)
    assert env["warnings"] == ["fd 3 is a pipe shared with pid 1 outside the tree"]


def test_quiet_keeps_warnings_and_drops_notes(capsys: pytest.CaptureFixture[str]) -> None:
    from npusnap_cli.ui import Output

    out = Output("x", quiet=True)
    out.info("… phase")
    out.line("a note")
    out.warn("careful")
    err = capsys.readouterr().err
    assert "careful" in err and "phase" not in err and "a note" not in err
