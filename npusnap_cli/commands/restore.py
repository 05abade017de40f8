"""`npusnap restore DIR`: bring back a process tree, device state included, from an image."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, output


def register(app: typer.Typer) -> None:
    @app.command()
    def restore(
        ctx: typer.Context,
        directory: Path = typer.Argument(..., help="The image directory written by `npusnap dump`."),
        no_verify: bool = typer.Option(
            False,
            "--no-verify",
            help="Skip the sha256 check of the image's files (structure and sizes are still checked).",
        ),
        pidfile: Optional[Path] = typer.Option(
            None, "--pidfile", help="Write the restored root pid into this file."
        ),
        accept_lost: bool = typer.Option(
            False,
            "--accept-lost-device-memory",
            help="Restore an image dumped with --device-memory discard: the job runs again with "
            "its device memory LOST (it must rebuild it). Refused without this flag.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Restore the process tree saved in DIR and its NPU device state; print the root pid.

        The image is verified first (schema, checksums, versions, pids and devices free): any
        problem is reported before anything is touched. CRIU then restores the tree, detached,
        and every NPU process gets its device state back and is unlocked. If that last step
        fails for a process, it stays locked and the error says how to retry.
        """
        from npusnap_cli import restore as restore_mod
        from npusnap_cli.commands.dump import ProgressBars, fmt_s

        out = output(ctx, "restore", json_flag)
        bars = ProgressBars(out)

        def phase(label: str) -> None:
            bars.close()
            out.info(f"… {label}")

        options = restore_mod.RestoreOptions(
            verify=not no_verify, pidfile=pidfile, accept_lost_device_memory=accept_lost
        )
        callbacks = restore_mod.RestoreCallbacks(phase=phase, progress=bars.update, note=out.warn)
        try:
            result = restore_mod.restore(directory, options, callbacks)
        finally:
            bars.close()
        t = result.timings
        if result.device_memory == "lost":
            out.warn(
                f"restored {len(result.pids)} process(es) from {result.image} (root pid "
                f"{result.root_pid}) WITHOUT their device memory: the image was dumped with "
                "--device-memory discard, so every device allocation holds undefined contents"
            )
        else:
            out.ok(
                f"restored {len(result.pids)} process(es) from {result.image}: root pid {result.root_pid}"
                + (f", NPU pid(s) {', '.join(map(str, result.npu_pids))} running" if result.npu_pids else "")
                + {
                    "npusnap": ", device memory written back by npusnap",
                    "application": ", device memory left to the application's hooks",
                }.get(result.device_memory or "", "")
            )
        out.table(
            "phases",
            ["phase", "time"],
            [
                ["verify", fmt_s(t.verify_s)],
                ["CRIU restore", fmt_s(t.criu_restore_s)],
                ["device restore + unlock", fmt_s(t.device_restore_s)],
                ["total", fmt_s(t.total_s)],
            ],
        )
        if result.pidfile:
            out.line(f"pid written to {result.pidfile}")
        out.result(result.to_dict())
