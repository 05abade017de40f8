"""`npusnap attach PID`: start an npusnap agent inside an already-running process."""

from __future__ import annotations

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.device import attach as attach_mod


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("attach"))
    def attach(
        ctx: typer.Context,
        pid: int = typer.Argument(
            ...,
            min=1,
            help="The running process (Python, or any with the CANN runtime loaded) to inject into.",
        ),
        timeout: float = typer.Option(
            10.0,
            "--timeout",
            min=1.0,
            help="Seconds to wait for a safe point, the bootstrap and the agent's hello (default 10).",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Inject the agent into running PID (Python 3.14+: sys.remote_exec; Python 3.9-3.13 and native
        programs with the CANN runtime loaded: gdb at a safe point).

        Succeeds only when the agent answers over its control socket; a no-op if one is already there.
        """

        out = output(ctx, "attach", json_flag)
        with out.phase(f"attaching to pid {pid}"):
            result = attach_mod.attach(pid, timeout=timeout)
        if result.method == "already-present":
            out.ok(f"pid {pid} already has an npusnap agent ({result.socket})")
        else:
            how = "sys.remote_exec" if result.method == "remote_exec" else f"gdb, {result.safe_point}"
            what = "native" if result.method == "gdb-native" else f"Python {result.python}"
            out.ok(f"agent started in pid {pid} ({what}, {how}) in {result.elapsed_s:.2f}s")
            info: dict[str, object] = {"socket": result.socket, "thread used": result.tid}
            if result.stopped_s is not None:
                parts = (
                    [f"ptrace {result.stop['ptrace_s']:.3f}s"]
                    if result.stop.get("ptrace_s") is not None
                    else []
                )
                gil_s = result.stop.get("gil_s")
                if gil_s is not None:
                    parts.append(f"GIL held by the bootstrap {float(gil_s):.3f}s")
                info["target stopped"] = f"{result.stopped_s:.3f}s at most" + (
                    f" ({', '.join(parts)})" if parts else ""
                )
            out.kv("agent", info)
        for note in result.notes:
            out.warn(note)
        out.result(result.to_dict())
