"""`npusnap qualify`: prove or refute on this node what npusnap assumes of an Ascend node."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.pipelines import qualify


def register(app: typer.Typer) -> None:
    @app.command("qualify", epilog=epilog("qualify"))
    def qualify_(
        ctx: typer.Context,
        device: int = typer.Option(
            0, "--device", help="The device to try (a program's device id; default 0)."
        ),
        ascend_home: Optional[str] = typer.Option(
            None,
            "--ascend-home",
            help="CANN installation to try (default: $ASCEND_HOME_PATH, /usr/local/Ascend/cann, "
            "/usr/local/Ascend/ascend-toolkit/latest).",
        ),
        report_file: Optional[Path] = typer.Option(
            None,
            "--report",
            help="Also write the JSON report to this file (0600), to attach to a bug report.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Prove or refute on this node, with a probe program of its own on an idle device, each
        assumption npusnap makes of an Ascend node.

        Run once as root after installing npusnap, and again after a CANN or driver upgrade. A
        verdict per check (pass, fail, skip and why); the JSON report goes into npusnap's state
        directory. Exit 0 when every check npusnap relies on passed, 3 otherwise; 11 when the
        device is busy.
        """

        out = output(ctx, "qualify", json_flag)
        report = qualify.run(device, ascend_home, progress=lambda step: out.debug(f"qualify: {step}"))
        written = qualify.write_report(report, report_file)
        styles = {qualify.PASS: None, qualify.FAIL: "red", qualify.SKIP: "yellow"}
        out.table(
            f"npusnap qualify (device {device})",
            ["check", "verdict", "found"],
            [(v.name, v.verdict, v.detail) for v in report.verdicts],
            styles=[styles[v.verdict] for v in report.verdicts],
        )
        code = report.exit_code()
        if report.passed:
            out.ok(f"every assumption npusnap relies on holds on this node (report: {written})")
        else:
            out.line(
                f"✘ assumptions npusnap relies on do not hold here: {', '.join(report.failed())}; attach "
                f"{written} to a bug report",
                style="red",
            )
        out.result(report.to_dict(), exit_code=code)
        raise typer.Exit(int(code))
