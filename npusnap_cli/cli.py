"""The typer application: global options, command registration and error-to-exit-code mapping.

Start-up must stay fast (``npusnap --help`` well under 200 ms, see bench/startup.py): command
modules import only typer and light npusnap modules at top level and import the heavy ones
(pycriu, psutil, protobuf, rich tables) inside the command function.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import click
import typer
import typer.core

from npusnap_cli import __version__
from npusnap_cli.commands import _common
from npusnap_cli.errors import ExitCode, InterruptedError_, NpusnapError, UsageError

# One module per verb (or verb group) under npusnap_cli/commands/; each exposes register(app).
COMMAND_MODULES = (
    "check",
    "sim",
    "run",
    "attach",
    "status",
    "ps",
    "freeze",
    "dump",
    "restore",
    "inspect",
    "images",
    "demo",
    "k8s",
)


# typer formats help through rich whenever rich is installed, which adds rich's imports to every
# `--help` (docs/benchmarks.md) and leaves "\\[default: ...]" escapes in plain output. Plain click
# help is enough.
typer.core.HAS_RICH = False


def _version_callback(value: bool) -> None:
    if value:
        print(f"npusnap {__version__}")
        raise typer.Exit(0)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="npusnap",
        help=(
            "Snapshot a running process that uses an Ascend NPU and restore it later, device state "
            "included. Start with `npusnap check`."
        ),
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _global(
        ctx: typer.Context,
        version: Optional[bool] = typer.Option(
            None, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
        ),
        json_output: bool = typer.Option(
            False,
            "--json",
            help="Print one JSON envelope on stdout instead of text, also on failure (diagnostics stay "
            "on stderr).",
        ),
        verbose: int = typer.Option(
            0,
            "-v",
            "--verbose",
            count=True,
            help="More detail on stderr: -v each step's details and the path of CRIU's log, -vv also "
            "debug logging and the end of CRIU's log. Accepted anywhere on the line.",
        ),
        quiet: bool = typer.Option(
            False,
            "-q",
            "--quiet",
            help="No progress, phases or notes on stderr; warnings, errors and data still appear. "
            "Accepted anywhere on the line.",
        ),
    ) -> None:
        ctx.obj = _common.GlobalOptions(json_output=json_output, verbose=verbose, quiet=quiet)
        if verbose:
            import logging

            logging.basicConfig(
                level=logging.DEBUG if verbose > 1 else logging.INFO,
                format="%(asctime)s %(name)s %(levelname)s %(message)s",
                stream=sys.stderr,
            )

    for name in COMMAND_MODULES:
        module = importlib.import_module(f"npusnap_cli.commands.{name}")
        module.register(app)
    return app


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``npusnap`` console script; returns the exit code."""
    args = _common.hoist_global_flags(sys.argv[1:] if argv is None else argv)
    _common.reset_output()  # a previous main() in this process (tests) must not leak its Output
    app = build_app()
    try:
        rv = app(args=args, prog_name="npusnap", standalone_mode=False)
    except NpusnapError as err:
        return _common.current_output(args).error(err)
    except (KeyboardInterrupt, click.exceptions.Abort):
        return _common.current_output(args).error(
            InterruptedError_("interrupted", why="Ctrl-C or SIGTERM", fix="rerun the command when ready")
        )
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        return _usage_error(args, exc)
    except Exception as exc:  # a bug: say so, keep the traceback for -v
        if _common.verbosity(args):
            import traceback

            traceback.print_exc()
        from npusnap_cli import ui  # lazy: --help cost (check_imports.py --costs)

        return ui.unexpected(_common.current_output(args), exc)
    return int(rv) if isinstance(rv, int) else 0


def _usage_error(args: list[str], exc: click.ClickException) -> int:
    """A bad command line: click's text, or with --json an error envelope like any other failure."""
    from npusnap_cli.ui import Output  # lazy: --help cost (check_imports.py --costs)

    if not _common.json_requested(args):
        exc.show()
        return int(ExitCode.USAGE)
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path.removeprefix("npusnap").strip() if ctx is not None else ""
    err = UsageError(
        exc.format_message(),
        why="the command line does not match the command's arguments and options",
        fix=f"see `npusnap {command + ' ' if command else ''}--help`",
        details={"usage": ctx.get_usage() if ctx is not None else ""},
    )
    return Output(command or "npusnap", json_mode=True).error(err)


if __name__ == "__main__":
    raise SystemExit(main())
