"""Every command, given --json and a bad command line, prints one parseable error envelope.

Scripts parse stdout whatever happened: a wrong type, a missing argument, an unknown option or
command must give the same envelope as any other failure (exit 2, ``error.kind`` "usage").
"""

from __future__ import annotations

import json
from typing import Any

import click
import pytest

from npusnap_cli.cli import main
from tests.unit.test_cli import all_commands

ENVELOPE_KEYS = {"schema", "command", "ok", "exit_code", "result", "error", "warnings"}
ERROR_KEYS = {"kind", "exit_code", "message", "why", "fix", "details"}


def _bad_inputs(name: str, cmd: click.Command) -> list[list[str]]:
    """Command lines that click must refuse before the command runs."""
    words = name.split()
    cases: list[list[str]] = []
    if name != "run":  # run passes unknown options to the program it runs
        cases.append([*words, "--json", "--no-such-option"])
    required = [p for p in cmd.params if isinstance(p, click.Argument) and p.required]
    if required:
        cases.append([*words, "--json"])  # missing argument
    for param in cmd.params:
        if isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)):
            flag = next((o for o in param.opts if o.startswith("--")), None)
            if isinstance(param, click.Option) and flag:
                args = ["1"] * len(required)
                cases.append([*words, "--json", flag, "not-a-number", *args])
            elif isinstance(param, click.Argument):
                cases.append([*words, "--json", "not-a-number", *["/tmp/x"] * (len(required) - 1)])
                if isinstance(param.type, click.types.IntParamType):
                    cases.append([*words, "--json", "--", "-5", *["/tmp/x"] * (len(required) - 1)])
    return cases


def _envelope(capsys: pytest.CaptureFixture[str], code: int, argv: list[str]) -> dict[str, Any]:
    out = capsys.readouterr().out
    try:
        env = json.loads(out)
    except ValueError:
        pytest.fail(f"`npusnap {' '.join(argv)}` printed no JSON envelope on stdout: {out!r}")
    assert set(env) == ENVELOPE_KEYS, argv
    assert env["exit_code"] == code and env["ok"] is False, argv
    assert set(env["error"]) == ERROR_KEYS, argv
    return dict(env)


def test_every_command_gives_a_json_envelope_for_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    tried = 0
    for name, cmd in all_commands():
        for argv in _bad_inputs(name, cmd):
            code = main(argv)
            env = _envelope(capsys, code, argv)
            assert code == 2 and env["error"]["kind"] == "usage", (argv, env)
            assert env["command"] == name, (argv, env["command"])
            assert f"npusnap {name} --help" in env["error"]["fix"]
            tried += 1
    assert tried >= 2 * len(all_commands())


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "no-such-command"],
        ["no-such-command", "--json"],
        ["--json", "sim", "no-such-command"],
        ["--json", "--no-such-global-option", "check"],
    ],
)
def test_unknown_commands_and_global_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(argv)
    env = _envelope(capsys, code, argv)
    assert code == 2 and env["error"]["kind"] == "usage"


def test_negative_pid_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["dump", "--json", "--", "-5", "/tmp/npusnap-never-written"])
    env = _envelope(capsys, code, ["dump"])
    assert code == 2 and "PID" in env["error"]["message"]


def test_sim_accepts_json_on_the_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--json", "env"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["ok"] is True and env["command"] == "sim env" and "NPUSIM_SOCKET" in env["result"]


def test_a_failure_inside_a_command_is_an_envelope_too(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--json", "freeze", "1", "--lease", "10", "--no-lease"])
    env = _envelope(capsys, code, ["freeze"])
    assert code == 2 and "--no-lease" in env["error"]["message"]
    # The same without --json is text on stderr and nothing on stdout.
    assert main(["freeze", "1", "--lease", "10", "--no-lease"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "contradict" in captured.err
