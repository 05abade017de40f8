"""`npusnap ps`: every process on this node that has an npusnap agent."""

from __future__ import annotations

import typer

from npusnap_cli.commands._common import JSON_HELP, clean_stale_sockets, epilog, output
from npusnap_cli.host import nodeview, procfs
from npusnap_cli.jsontypes import obj

MIN_AGENT_WAIT_S = 0.5  # what the agents get however slow the start was: a live one answers in ms


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("ps"))
    def ps(
        ctx: typer.Context,
        timeout: float = typer.Option(
            2.0,
            "--timeout",
            min=0.1,
            help="Seconds, counted from the command's start, within which every agent must have "
            "answered (they are asked in parallel); one that has not is listed with a warning.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """List every process on this node with an npusnap agent (replicas restored by
        `restore --replicas` included): its state, who holds its lock (and whether that command
        still runs), its lease and its last snapshot."""

        out = output(ctx, "ps", json_flag)
        clean_stale_sockets(out)
        # Counted from the process's start: on a loaded node the interpreter's start-up alone can
        # take a second, and `ps` is to end within about --timeout whatever the agents do.
        spent = procfs.age() or 0.0
        procs = nodeview.processes(timeout=max(MIN_AGENT_WAIT_S, timeout - spent))
        rows = []
        for p in procs:
            a = p.answer or nodeview.AgentAnswer()
            lease = obj(a.lease)
            last = p.last_snapshot or {}
            restored = p.restored_from or {}
            snap = f"{last.get('op')} {last.get('time')} -> {last.get('image') or '-'}" if last else "-"
            if restored:
                snap += f" (restored from {restored.get('image')} {restored.get('time')})"
            rows.append(
                (
                    p.pid,
                    p.user or "?",
                    (" ".join(p.cmdline) or "?") + (f" (replica of {p.replica_of})" if p.replica_of else ""),
                    a.state or ("agent error" if p.agent_error else "-"),
                    f"{lease.get('remaining_s')}s left" if lease.get("active") else "-",
                    nodeview.owner_text(a.owner, lease),
                    ",".join(map(str, a.devices)) or "-",
                    snap,
                )
            )
        out.table(
            "npusnap ps",
            ["pid", "user", "command", "state", "lease", "locked by", "devices", "last snapshot"],
            rows,
        )
        for p in procs:
            if p.agent_error:
                out.warn(f"pid {p.pid}: {p.agent_error}")
            owner = (p.answer.owner if p.answer else None) or {}
            if owner.get("alive") is False:
                out.warn(
                    f"pid {p.pid} is locked by {owner.get('command')} (pid {owner.get('pid')}), which "
                    f"has exited: `npusnap thaw --force {p.pid}` returns it now"
                )
        if not procs:
            out.line("no process on this node has an npusnap agent (start one with `npusnap run`)")
        out.result({"processes": [p.to_json() for p in procs]})
