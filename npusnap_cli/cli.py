"""The typer application: global options, the command table and error-to-exit-code mapping.

Start-up must stay fast (``npusnap --help`` within 100 ms, see bench/startup.py): the commands
are a table (name -> module, summary) behind a lazy group, so `npusnap --help` lists them from
the table and a command line imports only its own command's module, which imports what it needs
at its top.
"""

from __future__ import annotations

import importlib
import sys
from typing import ClassVar, Optional

import click
import typer
import typer.core

from npusnap_cli import __version__, paths
from npusnap_cli.commands import _common
from npusnap_cli.errors import ExitCode, InterruptedError_, NpusnapError, UsageError

# Every command, in `npusnap --help`'s order: name -> (its module, which exposes register(app): a
# bare name is a module under npusnap_cli/commands/, a dotted one the full name of a module outside
# the product; the summary `--help` lists, its docstring's first sentence, which
# tests/unit/test_cli.py holds to the command's own). The stand-ins' commands (`demo`, `sim`) live
# in their own packages, named here by their full names: the product reaches the simulator and the
# workloads only when one of those commands runs (scripts/check_layers.py forbids any other way).
COMMANDS: dict[str, tuple[str, str]] = {
    "check": (
        "check",
        "Check that this host can dump and restore NPU processes (CRIU, pycriu, privileges, CANN).",
    ),
    "qualify": (
        "qualify",
        "Prove or refute on this node, with a probe program of its own on an idle device, each "
        "assumption npusnap makes of an Ascend node.",
    ),
    "run": ("run", "Run CMD with an npusnap agent in every process it starts, Python or not."),
    "attach": (
        "attach",
        "Inject the agent into running PID (Python 3.14+: sys.remote_exec; Python 3.9-3.13 and native "
        "programs with the CANN runtime loaded: gdb at a safe point).",
    ),
    "status": (
        "status",
        "Show each process of PID's tree: agent, CANN runtime, devices, snapshot state, lease, and "
        "which npusnap command holds its lock and since when.",
    ),
    "ps": (
        "ps",
        "List every process on this node with an npusnap agent (replicas restored by `restore "
        "--replicas` included): its state, who holds its lock (and whether that command still runs), "
        "its lease and its last snapshot.",
    ),
    "freeze": (
        "freeze",
        "Lock and back up the CANN runtime of every NPU process of PID's tree (device half only).",
    ),
    "thaw": ("freeze", "Bring every NPU process of PID's tree back to RUNNING, whatever its snapshot state."),
    "dump": ("dump", "Snapshot PID's process tree, NPU device state included, into DIR."),
    "restore": (
        "restore",
        "Restore the process tree saved in DIR and its NPU device state; print the root pid on stdout.",
    ),
    "inspect": (
        "inspect",
        "Show what an image holds: by default the summary (versions, sizes, devices) and the process "
        "tree, with counts of what CRIU saved; --files, --sockets, --mounts and --stats show those (as "
        "checkpointctl's filters do), --all everything.",
    ),
    "verify": (
        "inspect",
        "Check an image: trust (only regular files, owner and modes, manifest schema and self-hash, the "
        "signature with --require-signature), every file present with its size and checksum (BLAKE3; "
        "sha256 in images made before 2026-12).",
    ),
    "list": ("images", "List the images (directories and archives) under DIR, newest first."),
    "export": (
        "images",
        "Write an image into one archive (tar + zstd on every core, or a plain tar with --compress "
        "none), verified on the way.",
    ),
    "import": (
        "images",
        "Extract an archive into a new image directory, verified, ready for `npusnap restore`.",
    ),
    "demo": (
        "npusnap_workloads.cli",
        "Run the main job: a training workload on the simulated NPU is dumped, restored and checked.",
    ),
    "sim": (
        "npusnap_sim.cli",
        "The simulated NPU (a device daemon + a fake CANN install) for hosts without Ascend hardware.",
    ),
    "k8s": ("k8s", "Kubernetes: checkpoint a job's containers across pods together (kubelet or CRI)."),
}


def module_path(module: str) -> str:
    """The importable name of a COMMANDS module: ``dump`` -> ``npusnap_cli.commands.dump``; a
    dotted name (``npusnap_sim.cli``) is already one."""
    return module if "." in module else f"npusnap_cli.commands.{module}"


def _commands_of(module: str) -> dict[str, click.Command]:
    """The click commands a command module registers (typer builds them)."""
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

    @sub.callback()
    def _group() -> None:  # a callback makes typer build a group, whatever the module registers
        pass

    importlib.import_module(module_path(module)).register(sub)
    group = typer.main.get_command(sub)
    assert isinstance(group, click.Group)
    return dict(group.commands)


class _LazyGroup(typer.core.TyperGroup):
    """The top-level group: commands come from COMMANDS, each module imported when its command
    runs (or its help is asked for), none for `npusnap --help`."""

    _loaded: ClassVar[dict[str, dict[str, click.Command]]] = {}  # module -> its commands, once

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _installed(name)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module = entry[0]
        if not _installed(cmd_name):
            raise UsageError(
                f"`npusnap {cmd_name}` is not installed here: it belongs to the simulated NPU's "
                "stand-ins, which a node install (scripts/install-node.sh) leaves out",
                fix="on a node, use its real NPU (docs/real-node.md); for the simulator, use a checkout "
                "set up with scripts/setup.sh",
            )
        if module not in self._loaded:
            self._loaded[module] = _commands_of(module)
        return self._loaded[module].get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [
            (name, click.Command(name, help=summary).get_short_help_str(limit))
            for name, (_m, summary) in COMMANDS.items()
            if _installed(name)
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _installed(name: str) -> bool:
    """A command of the product, or a stand-in's whose package is installed (not on a node)."""
    module = COMMANDS[name][0]
    return "." not in module or paths.standin_installed(module.split(".")[0])


def load_all() -> None:
    """Import every command module of the product now (a parent that forks children which must
    import nothing); not the stand-ins' (dotted names): no such child runs `sim` or `demo`."""
    for module in dict.fromkeys(m for m, _summary in COMMANDS.values() if "." not in m):
        importlib.import_module(module_path(module))


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
        cls=_LazyGroup,
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
