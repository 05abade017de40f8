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
        pipe_to: Optional[Path] = typer.Option(
            None,
            "--pipe-to",
            help="For an image dumped with --external-pipes: the restored job writes what went "
            "into those pipes to this file (appended; created 0600 if missing).",
        ),
        replace_tmpfs_files: bool = typer.Option(
            False,
            "--replace-tmpfs-files",
            help="Overwrite tmpfs files (/dev/shm ...) that changed since the dump with the image's "
            "copies, instead of refusing.",
        ),
        settle: float = typer.Option(
            0.5,
            "--settle",
            min=0.0,
            max=60.0,
            help="Seconds to watch the restored tree after it resumed; a process that died in "
            "that time fails the restore.",
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
            verify=not no_verify,
            pidfile=pidfile,
            pipe_to=pipe_to,
            replace_tmpfs_files=replace_tmpfs_files,
            settle_s=settle,
        )
        callbacks = restore_mod.RestoreCallbacks(phase=phase, progress=bars.update, note=out.warn)
        restore_mod.become_subreaper()
        try:
            result = restore_mod.restore(directory, options, callbacks)
        finally:
            bars.close()
        t = result.timings
        out.ok(
            f"restored {len(result.pids)} process(es) from {result.image}: root pid {result.root_pid}"
            + (f", NPU pid(s) {', '.join(map(str, result.npu_pids))} running" if result.npu_pids else "")
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
