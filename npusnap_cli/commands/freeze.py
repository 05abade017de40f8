"""`npusnap freeze PID` / `npusnap thaw PID`: park and resume the NPU runtime of a process tree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import typer

from npusnap_cli import replies
from npusnap_cli.commands._common import JSON_HELP, clean_stale_sockets, epilog, output
from npusnap_cli.errors import UsageError
from npusnap_cli.host import oplog
from npusnap_cli.jsontypes import JSONObject, JSONValue
from npusnap_cli.pipelines import freeze as freeze_mod

DEFAULT_FREEZE_LEASE_S = 300.0


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("freeze"))
    def freeze(
        ctx: typer.Context,
        pid: int = typer.Argument(..., min=1, help="The process to freeze (every NPU process of its tree)."),
        lease: Optional[float] = typer.Option(
            None,
            "--lease",
            min=0.1,
            help=f"Thaw by itself after this many seconds of run time unless thawed or renewed "
            f"(default {DEFAULT_FREEZE_LEASE_S:g}: longer than dump's 60, because a freeze waits for a "
            "person or an external tool, a dump only for npusnap itself).",
        ),
        no_lease: bool = typer.Option(
            False, "--no-lease", help="Stay frozen until `npusnap thaw PID`, however long that takes."
        ),
        backup: bool = typer.Option(
            True,
            "--backup/--no-backup",
            help="Back up device state into host memory after the Lock, as a dump does (needed before "
            "an external CRIU checkpoint); --no-backup only Locks.",
        ),
        timeout: float = typer.Option(30.0, "--timeout", min=1.0, help="Seconds to wait for each agent."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Lock and back up the CANN runtime of every NPU process of PID's tree (device half only).

        Device work blocks until `npusnap thaw PID`. By default a lease thaws the processes by
        themselves after --lease seconds of run time, so a forgotten freeze cannot hang a job.
        All or nothing: if one process cannot be frozen, all are thawed again. A job that another
        command has locked is refused (exit 11), naming it; Ctrl-C/SIGTERM rolls back (exit 130).
        """

        out = output(ctx, "freeze", json_flag)
        if no_lease and lease is not None:
            raise UsageError(
                "--lease and --no-lease contradict each other",
                why="--no-lease means no time limit; --lease sets one",
                fix=f"give one of them: `npusnap freeze {pid} --lease {lease:g}` or "
                f"`npusnap freeze {pid} --no-lease`",
            )
        clean_stale_sockets(out)
        lease_s: Optional[float] = None if no_lease else (DEFAULT_FREEZE_LEASE_S if lease is None else lease)

        with out.phase("freezing"), oplog.operation("freeze", [pid], None):
            results = freeze_mod.freeze(pid, lease_s=lease_s, backup=backup, timeout=timeout, note=out.warn)
        out.table(
            f"npusnap freeze {pid}",
            ["pid", "state", "lease"],
            [(p, r.state, _lease_text(r.lease)) for p, r in sorted(results.items())],
        )
        if lease_s is None:
            out.ok(f"frozen until `npusnap thaw {pid}`")
        else:
            out.ok(f"frozen; thaws by itself after {lease_s:g}s of run time unless `npusnap thaw {pid}`")
        processes = _by_pid({p: r.to_json() for p, r in results.items()})
        out.result({"pid": pid, "lease_s": lease_s, "backup": backup, "processes": processes})

    @app.command(epilog=epilog("thaw"))
    def thaw(
        ctx: typer.Context,
        pid: int = typer.Argument(..., min=1, help="The process to thaw (every NPU process of its tree)."),
        timeout: float = typer.Option(30.0, "--timeout", min=1.0, help="Seconds to wait for each agent."),
        force: bool = typer.Option(
            False,
            "--force",
            help="Thaw even a lock another command holds (a dump in progress, someone's external "
            "checkpoint): that command will fail.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Bring every NPU process of PID's tree back to RUNNING, whatever its snapshot state.

        From BACKED_UP this unlocks directly (device memory is intact), except in a process that
        CRIU restored, where Restore comes first. Safe to run on a process that is running.
        Thaws what `npusnap freeze` locked; a lock another command holds is refused (exit 11,
        naming it) unless --force.
        """

        out = output(ctx, "thaw", json_flag)
        clean_stale_sockets(out)

        with oplog.operation("thaw", [pid], None):
            results = freeze_mod.thaw(pid, force=force, timeout=timeout)
        out.table(
            f"npusnap thaw {pid}",
            ["pid", "was", "actions", "state"],
            [(p, r.before, ", ".join(r.actions) or "none", r.state) for p, r in sorted(results.items())],
        )
        for p, r in sorted(results.items()):
            for warning in r.warnings:
                out.warn(f"pid {p}: {warning}")
        out.ok(f"{len(results)} process(es) running")
        out.result({"pid": pid, "processes": _by_pid({p: r.to_json() for p, r in results.items()})})


def _lease_text(lease: replies.Lease) -> str:
    return f"{lease.remaining_s}s" if lease.active else "none"


def _by_pid(results: Mapping[int, Mapping[str, JSONValue]]) -> list[JSONObject]:
    """``processes`` has one shape in every command's JSON: a list of objects with ``pid``."""
    return [{**r, "pid": p} for p, r in sorted(results.items())]
