"""`npusnap check`: the preflight an operator runs first."""

from __future__ import annotations

from typing import Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.errors import ExitCode
from npusnap_cli.host import preflight


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("check"))
    def check(
        ctx: typer.Context,
        ascend_home: Optional[str] = typer.Option(
            None,
            "--ascend-home",
            help="CANN installation to check (default: $ASCEND_HOME_PATH, /usr/local/Ascend/cann, "
            "/usr/local/Ascend/ascend-toolkit/latest).",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Check that this host can dump and restore NPU processes (CRIU, pycriu, privileges, CANN).

        Exit 0 when dump and restore are possible, 3 (preflight) otherwise.
        """

        out = output(ctx, "check", json_flag)
        report = preflight.run_checks(ascend_home)
        marks = {
            preflight.OK: "ok",
            preflight.PROBLEM: "PROBLEM",
            preflight.WARNING: "warning",
            preflight.INFO: "info",
        }
        styles = {
            preflight.OK: None,
            preflight.PROBLEM: "red",
            preflight.WARNING: "yellow",
            preflight.INFO: "dim",
        }
        out.table(
            "npusnap check",
            ["check", "status", "found", "how to fix"],
            [(i.name, marks[i.status], i.detail, i.fix) for i in report.items],
            styles=[styles[i.status] for i in report.items],
        )
        code = ExitCode.OK if report.ready else ExitCode.PREFLIGHT
        warned = [i for i in report.items if i.status == preflight.WARNING]
        for item in warned:
            out.record_warning(f"{item.name}: {item.detail}")
        if report.ready and warned:
            # Not an unqualified yes: a warning row is a limit (e.g. root that cannot dump
            # another user's job), and an operator stops reading at the tick.
            out.ok(
                "this host can dump and restore NPU processes, within the limits above: "
                + ", ".join(i.name for i in warned)
            )
        elif report.ready:
            out.ok("this host can dump and restore NPU processes")
        else:
            out.line("✘ dump/restore is not possible on this host: fix the problems above", style="red")
        out.result(report.to_dict(), exit_code=code)
        raise typer.Exit(int(code))
