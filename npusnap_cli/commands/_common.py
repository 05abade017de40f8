"""Helpers shared by the command modules: global options, the current Output, option types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:  # imported when a command runs, not for every --help
    from npusnap_cli.ui import Output

JSON_HELP = "Print one JSON envelope on stdout instead of text, also on failure (diagnostics stay on stderr)."


@dataclass(frozen=True)
class GlobalOptions:
    json_output: bool = False
    verbose: int = 0


_current: Optional[Output] = None


def output(ctx: typer.Context, command: str, json_flag: bool = False) -> Output:
    """The Output for this command; ``--json`` may be given globally or on the command."""
    from npusnap_cli.ui import Output

    global _current
    opts = ctx.find_root().obj if ctx.find_root().obj is not None else GlobalOptions()
    _current = Output(command, json_mode=json_flag or opts.json_output, verbose=opts.verbose)
    return _current


def reset_output() -> None:
    global _current
    _current = None


def options_part(argv: list[str]) -> list[str]:
    """The arguments before ``--`` (what follows is a program's command line, e.g. `run`'s)."""
    return argv[: argv.index("--")] if "--" in argv else argv


def json_requested(argv: list[str]) -> bool:
    return "--json" in options_part(argv)


def command_name(argv: list[str]) -> str:
    """Best guess at the command from raw arguments (before typer parsed them): its words."""
    words = [a for a in options_part(argv) if not a.startswith("-")]
    if not words:
        return "npusnap"
    return " ".join(words[:2]) if words[0] == "sim" and len(words) > 1 else words[0]


def verbosity(argv: list[str]) -> int:
    """How many -v/--verbose (``-vv`` counts two) are in the raw arguments."""
    count = 0
    for arg in argv:
        if arg == "--verbose":
            count += 1
        elif arg.startswith("-v") and set(arg[1:]) == {"v"}:
            count += len(arg) - 1
    return count


def current_output(argv: list[str]) -> Output:
    """The command's Output if it got that far, else one built from the raw arguments."""
    from npusnap_cli.ui import Output

    if _current is not None:
        return _current
    return Output(command_name(argv), json_mode=json_requested(argv))


def clean_stale_sockets(out: Output) -> None:
    """Remove agent sockets whose process is gone (see hostclean.py); commands that look for
    agents call this first, so that /run/npusnap holds only live agents."""
    from npusnap_cli.host import hostclean

    for entry in hostclean.remove_stale_agent_sockets():
        out.debug(f"removed stale agent socket or lock token {entry.path} ({entry.reason})")
