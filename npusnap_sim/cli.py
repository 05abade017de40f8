"""`npusnap sim start|stop|status|env|ops`: run the simulated NPU used when no Ascend hardware is
present, and say which of torch_npu's operators it implements."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, GlobalOptions, epilog, output
from npusnap_cli.errors import UsageError
from npusnap_cli.ui import human_bytes
from npusnap_sim import manager, opscover

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}
_UNITS.update({"kb": 1000, "mb": 1000**2, "gb": 1000**3, "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4})


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1000000' -> bytes (binary units for K/M/G/T and KiB.., decimal for KB..)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"not a size: {text!r}", fix="use a number of bytes or e.g. 512MiB, 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _device_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:

    rows: list[tuple[str, ...]] = []
    for d in doc.get("devices", []):
        owners = d.get("owners") or ([d["owner"]] if d.get("owner") else [])
        who = (
            ", ".join(f"pid {o['pid']}" + ("" if o.get("alive") else " (gone)") for o in owners)
            if owners
            else "-"
        )
        rows.append(
            (
                str(d["id"]),
                who,
                f"{human_bytes(d['used'])} / {human_bytes(d['capacity'])}",
                str(d["allocations"]),
            )
        )
    return rows


def register(app: typer.Typer) -> None:
    sim = typer.Typer(
        name="sim",
        help="The simulated NPU (a device daemon + a fake CANN install) for hosts without Ascend hardware.",
        no_args_is_help=True,
    )

    @sim.callback()
    def _sim_options(
        ctx: typer.Context, json_flag: bool = typer.Option(False, "--json", help=JSON_HELP)
    ) -> None:
        """The simulated NPU (a device daemon + a fake CANN install) for hosts without Ascend hardware."""
        import dataclasses

        root = ctx.find_root()
        if json_flag:
            root.obj = dataclasses.replace(root.obj or GlobalOptions(), json_output=True)

    @sim.command("start", epilog=epilog("sim start"))
    def start_cmd(
        ctx: typer.Context,
        devices: int = typer.Option(2, "--devices", help="Number of simulated devices."),
        capacity: str = typer.Option("4GiB", "--capacity", help="Memory per device, e.g. 4GiB or 512MiB."),
        bandwidth_mbps: Optional[float] = typer.Option(
            None,
            "--bandwidth-mbps",
            help="Cap device<->host copies at this many megabytes (10^6 bytes, as link speeds are "
            "quoted) per second (default: no cap).",
        ),
        keep_contents: bool = typer.Option(
            False,
            "--keep-contents",
            help="Restore brings back allocation contents. NOT what CANN does (its Restore keeps only "
            "addresses); for experiments only.",
        ),
        driver_snapshot: bool = typer.Option(
            False,
            "--driver-snapshot",
            help="The simulated driver has the feature of CANN's driver-backed snapshot flow "
            "(args != NULL; used with NPUSIM_CANN=9.2). Off, as on released drivers.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Build the simulator if needed and start its daemon (does nothing if it is running).

        By default the simulator is truthful: like CANN's Restore, it gives every allocation back
        at its address but not its contents (they read as 0xDEADBEEF words); npusnap keeps the
        job's device memory itself (docs/device-memory.md).
        """

        out = output(ctx, "sim start", json_flag)
        doc = manager.start(
            devices,
            parse_size(capacity),
            bandwidth_mbps,
            keep_contents=keep_contents,
            driver_snapshot=driver_snapshot,
        )
        if doc.get("keep_contents"):
            out.warn(
                "the simulator runs with --keep-contents: Restore keeps device memory contents, "
                "which real CANN does not do; results prove nothing about hardware"
            )
        if doc.get("faults"):
            out.warn(
                f"the simulated node has faults ({', '.join(doc['faults'])}, from NPUSIM_NODE_FAULT): it "
                "breaks npusnap's assumptions on purpose (docs/simulator.md)"
            )
        if doc["started"]:
            out.ok(f"simulated NPU started: {len(doc['devices'])} devices, daemon pid {doc['daemon_pid']}")
        else:
            out.ok(f"simulated NPU already running (daemon pid {doc['daemon_pid']}); configuration unchanged")
            wanted = (devices, parse_size(capacity))
            have = (len(doc["devices"]), doc["devices"][0]["capacity"] if doc["devices"] else 0)
            if wanted != have or bool(doc.get("keep_contents")) != keep_contents:
                out.warn("it runs with a different configuration: `npusnap sim stop` first to change it")
        out.line(f"socket: {doc['socket']}   log: {doc['log']}")
        out.line('use it: eval "$(npusnap sim env)"')
        out.result(doc)

    @sim.command("stop", epilog=epilog("sim stop"))
    def stop_cmd(ctx: typer.Context, json_flag: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
        """Stop the simulator's daemon. Processes still using it lose their device memory."""

        out = output(ctx, "sim stop", json_flag)
        was_running = manager.stop()
        out.ok("simulated NPU stopped" if was_running else "simulated NPU was not running")
        out.result({"stopped": was_running, "socket": str(manager.socket_path())})

    @sim.command("status", epilog=epilog("sim status"))
    def status_cmd(
        ctx: typer.Context, json_flag: bool = typer.Option(False, "--json", help=JSON_HELP)
    ) -> None:
        """Show the simulated devices, which process owns each, and the memory in use."""

        out = output(ctx, "sim status", json_flag)
        doc = manager.status()
        if not doc["running"]:
            out.warn(f"simulated NPU is not running (socket {doc['socket']}); start it: npusnap sim start")
        else:
            out.table(
                f"simulated NPU (daemon pid {doc['daemon_pid']}, {doc['socket']})",
                ["device", "owner", "memory", "allocations"],
                _device_rows(doc),
            )
        out.result(doc)

    @sim.command("env", epilog=epilog("sim env"))
    def env_cmd(ctx: typer.Context, json_flag: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
        """Print `export` lines for the simulator: eval "$(npusnap sim env)"."""

        out = output(ctx, "sim env", json_flag)
        variables = manager.env()
        if out.json_mode:
            out.result(variables)
            return
        # Plain stdout on purpose: this is meant for eval in a shell, not for people.
        for key, value in variables.items():
            typer.echo(f"export {key}={shlex.quote(value)}")

    @sim.command("ops", epilog=epilog("sim ops"))
    def ops_cmd(
        ctx: typer.Context,
        torch_npu: Optional[Path] = typer.Option(
            None,
            "--torch-npu",
            help="The torch_npu install to read: its site-packages, the torch_npu package directory, "
            "a venv or libtorch_npu.so (default: the .build/torch-npu venv's site-packages).",
        ),
        missing: bool = typer.Option(
            False, "--missing", help="List the operators the simulator lacks instead of those it has."
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Which aclnn operators the torch_npu wheel looks up are implemented by the simulator.

        Reads the aclnn names in torch_npu's libtorch_npu.so (what op-plugin finds with dlsym;
        the ...GetWorkspaceSize halves folded in) and the exports of the simulator's libopapi.so;
        neither is loaded. Prints the counts on stderr and one name a line on stdout.
        """

        out = output(ctx, "sim ops", json_flag)
        cov = opscover.coverage(torch_npu)
        looked = len(cov.looked_up)
        share = f" ({100 * len(cov.implemented) / looked:.0f} %)" if looked else ""
        out.kv(
            "aclnn operators: torch_npu's lookups against the simulator",
            {
                "torch_npu": cov.wheel_library,
                "simulator": cov.opapi,
                "looked up": str(looked),
                "implemented": f"{len(cov.implemented)}{share}",
                "missing": str(len(cov.missing)),
            },
            stream="stderr",
        )
        for name in cov.missing if missing else cov.implemented:
            out.data(name)
        out.result(cov.to_dict())

    app.add_typer(sim, name="sim")
