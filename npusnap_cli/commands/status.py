"""`npusnap status PID`: the agent and snapshot state of a process and of every process in its tree."""

from __future__ import annotations

import typer

from npusnap_cli.commands._common import JSON_HELP, clean_stale_sockets, epilog, output
from npusnap_cli.host import nodeview, oplog, proctree
from npusnap_cli.ui import human_bytes


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("status"))
    def status(
        ctx: typer.Context,
        pid: int = typer.Argument(..., min=1, help="The process to inspect (its children are included)."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Show each process of PID's tree: agent, CANN runtime, devices, snapshot state, lease, and
        which npusnap command holds its lock and since when."""

        out = output(ctx, "status", json_flag)
        clean_stale_sockets(out)
        untracked = []
        report = proctree.tree_status(pid)
        rows = []
        busy: dict[int, oplog.RunningRecord] = {}
        for entry in report["processes"]:
            hello = entry.get("hello") or {}
            st = entry.get("status") or {}
            lease = st.get("lease") or {}
            agent = "yes" if entry["agent_socket"] else "no"
            holder = oplog.running_on(entry["pid"]) if entry.get("agent_error") else None
            if holder is not None:
                # The agent serves the command that holds it (a long dump copies for seconds)
                # and answers nobody else meanwhile: not an agent error.
                busy[entry["pid"]] = holder
                entry["agent_error"] = None
                entry["held_by"] = holder.to_json()
                agent = "busy"
                st = {
                    "state": "LOCKED",
                    "owner": {"command": holder.op, "pid": holder.pid, "since": holder.since},
                }
            elif entry.get("agent_error"):
                agent = "error"
            lease_text = f"{lease.get('remaining_s')}s left" if lease.get("active") else "-"
            owner = nodeview.owner_view(st.get("owner"))
            if owner is not None:
                st["owner"] = owner  # with "alive": a dead holder holds nothing
            owner_text = nodeview.owner_text(owner, lease)
            # Physical devices, what a restore compares; the program's own ids beside them when
            # they differ (a copy in a container, ASCEND_RT_VISIBLE_DEVICES).
            devices = entry.get("devices") or []
            program = entry.get("program_devices") or []
            devices_text = ",".join(map(str, devices)) or "-"
            if program and program != devices:
                devices_text += f" (its {','.join(map(str, program))})"
            # Who keeps its device memory across a snapshot (docs/device-memory.md).
            dm = st.get("device_memory") or hello.get("device_memory") or {}
            if not entry["agent_socket"] or not entry["uses_npu"] or entry["pid"] in busy:
                memory = "-"
            elif dm.get("interposed"):
                memory = f"seen: {human_bytes(int(dm.get('bytes') or 0))} in {dm.get('allocations')}"
            elif dm.get("registered"):
                memory = f"registered: {human_bytes(int(dm.get('bytes') or 0))}"
            else:
                memory = "not seen"
                untracked.append(entry["pid"])
            # Runtime loaded but never a device opened, its agent unreachable: left to CRIU.
            npu_text = "yes" if entry["uses_npu"] else "no"
            if entry.get("without_device_state"):
                npu_text = "no device"
            rows.append(
                (
                    f"{entry['pid']} (ns {entry['ns_pid']})" if entry.get("ns_pid") else entry["pid"],
                    "  " * entry["depth"] + (" ".join(entry["cmdline"]) or entry["name"]),
                    agent,
                    npu_text,
                    devices_text,
                    memory,
                    st.get("state") or "-",
                    lease_text,
                    owner_text,
                )
            )
        out.table(
            f"npusnap status {pid}",
            ["pid", "command", "agent", "npu", "devices", "device memory", "state", "lease", "locked by"],
            rows,
        )
        for p, holder in sorted(busy.items()):
            out.info(
                f"pid {p}: a {holder.op} holds the lock (npusnap pid {holder.pid}, since "
                f"{holder.since}); its agent answers again when that command is done"
            )
        for p in untracked:
            out.warn(
                f"pid {p}: npusnap does not see its device memory (not started with `npusnap run`, no "
                "buffer registered): `npusnap dump` refuses it unless --device-memory app or discard"
            )
        for entry in report["processes"]:
            if entry.get("agent_error"):
                out.warn(f"pid {entry['pid']}: {entry['agent_error']['message']}")
            st = entry.get("status") or {}
            owner = st.get("owner") or {}
            if owner.get("alive") is False:
                out.warn(
                    f"pid {entry['pid']}: the lock's holder, {owner.get('command')} (pid "
                    f"{owner.get('pid')}), has exited; `npusnap thaw --force {entry['pid']}` returns the "
                    "process now"
                )
            comms = st.get("hccl") or []
            if comms:
                # The HCCL communicators the agent stands behind (docs/distributed.md).
                out.info(
                    f"pid {entry['pid']}: HCCL communicator(s): "
                    + "; ".join(
                        f"{c.get('key', '')[:12]} rank {c.get('rank')}/{c.get('nranks')} {c.get('state')}"
                        for c in comms
                    )
                )
            events = st.get("events", [])[-3:]
            if events:
                # Past events, time-stamped: the state column is the present.
                out.info(
                    f"pid {entry['pid']}: last {len(events)} agent event(s), finished "
                    f"(state now: {st.get('state')}):"
                )
                for event in events:
                    out.info(f"    {event}")
        # The agents' messages are never in the job's own output: where there is something to
        # read (events, an error), say where they are; a healthy job's status stays quiet.
        logs = sorted(
            {
                str(e["hello"]["log"])
                for e in report["processes"]
                if (e.get("hello") or {}).get("log")
                and ((e.get("status") or {}).get("events") or e.get("agent_error"))
            }
        )
        for path in logs:
            out.info(f"agent log: {path}")
        for hint in report["hints"]:
            out.warn(hint)
        out.result(report)
