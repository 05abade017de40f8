"""`npusnap dump PID DIR`: snapshot a running NPU process tree (device state included) into DIR."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, output


class ProgressBars:
    """Opens one Output.progress bar per label on first use; closes them all at the end."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._stack = contextlib.ExitStack()
        self._bars: dict[str, Any] = {}

    def update(self, label: str, done: int, total: Optional[int]) -> None:
        bar = self._bars.get(label)
        if bar is None:
            bar = self._stack.enter_context(self._out.progress(label, total))
            self._bars[label] = bar
        bar.update(done, total)

    def close(self) -> None:
        self._stack.close()
        self._bars.clear()


def fmt_s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}s"


def register(app: typer.Typer) -> None:
    @app.command()
    def dump(
        ctx: typer.Context,
        pid: int = typer.Argument(..., help="Root of the process tree to snapshot."),
        directory: Path = typer.Argument(..., help="Image directory to create (new or empty)."),
        leave_running: bool = typer.Option(
            False, "--leave-running", help="Keep the original running after the dump (as `criu dump -R`)."
        ),
        tcp_established: bool = typer.Option(
            False, "--tcp-established", help="Dump established TCP connections (CRIU's --tcp-established)."
        ),
        shell_job: bool = typer.Option(
            False, "--shell-job", help="The tree was started from a shell and shares its session/tty."
        ),
        file_locks: bool = typer.Option(False, "--file-locks", help="Dump file locks (CRIU's --file-locks)."),
        ext_unix_sk: bool = typer.Option(
            False,
            "--ext-unix-sk",
            help="Allow unix sockets connected outside the tree (as CRIU's).",
        ),
        external: Optional[list[str]] = typer.Option(
            None, "--external", help="Mark a resource external, as CRIU's --external (repeatable)."
        ),
        timeout: Optional[int] = typer.Option(
            None, "--timeout", min=1, help="Seconds CRIU may take to freeze the tree (CRIU's --timeout)."
        ),
        keep: bool = typer.Option(
            False, "--keep", help="Keep CRIU's logs in the image (DIR/logs) on success too."
        ),
        force: bool = typer.Option(False, "--force", help="Replace DIR if it exists and is not empty."),
        no_attach: bool = typer.Option(
            False,
            "--no-attach",
            help="Fail instead of injecting an agent into NPU processes without one.",
        ),
        link_remap: bool = typer.Option(
            True,
            "--link-remap/--no-link-remap",
            help="Save deleted files the tree still has open, e.g. the /dev/shm semaphores of "
            "multiprocessing's spawn/forkserver pools (CRIU's --link-remap; on by default).",
        ),
        network_lock: Optional[str] = typer.Option(
            None,
            "--network-lock",
            help="How CRIU blocks the network while dumping TCP connections: nftables (no binary "
            "needed), iptables or skip. Default: nftables where CRIU has it.",
        ),
        external_pipes: bool = typer.Option(
            False,
            "--external-pipes",
            help="Allow pipes to processes outside the tree (`job | tee log`); the image records "
            "them and restore needs --pipe-to FILE to give the job a new output.",
        ),
        lease: float = typer.Option(
            60.0,
            "--lease",
            min=1.0,
            help="Seconds each agent waits for npusnap before rolling its process back by itself.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Snapshot PID's process tree, NPU device state included, into DIR.

        Every NPU process is locked and backed up in parallel, CRIU dumps the tree, and the image
        is renamed into place only when complete. By default the original tree is gone
        afterwards; with --leave-running it keeps running. Any failure rolls every process back
        (running, unlocked) and removes the partial image; the exit code names the failed stage.
        """
        from npusnap_cli import criu
        from npusnap_cli import dump as dump_mod
        from npusnap_cli.errors import UsageError
        from npusnap_cli.ui import human_bytes

        if network_lock is not None and network_lock not in criu.NETWORK_LOCKS:
            raise UsageError(
                f"--network-lock {network_lock!r} is not a network lock method",
                fix=f"use one of: {', '.join(criu.NETWORK_LOCKS)}",
            )

        out = output(ctx, "dump", json_flag)
        bars = ProgressBars(out)

        def phase(label: str) -> None:
            bars.close()
            out.info(f"… {label}")

        options = dump_mod.DumpOptions(
            leave_running=leave_running,
            tcp_established=tcp_established,
            shell_job=shell_job,
            file_locks=file_locks,
            ext_unix_sk=ext_unix_sk,
            external=tuple(external or ()),
            timeout=timeout,
            keep=keep,
            force=force,
            attach=not no_attach,
            lease_s=lease,
            link_remap=link_remap,
            network_lock=network_lock,
            external_pipes=external_pipes,
        )
        callbacks = dump_mod.DumpCallbacks(phase=phase, progress=bars.update, note=out.warn)
        try:
            result = dump_mod.dump(pid, directory, options, callbacks)
        finally:
            bars.close()
        m = result.manifest
        t = m.timings
        out.ok(
            f"dumped pid {pid} ({len(m.processes)} process(es), {len(m.npu_processes)} on the NPU) "
            f"into {result.image}"
        )
        out.table(
            "phases",
            ["phase", "time"],
            [
                ["lock", fmt_s(t.lock_s)],
                ["device backup", fmt_s(t.backup_s)],
                ["CRIU freeze", fmt_s(t.criu_freeze_s)],
                ["CRIU memory dump", fmt_s(t.criu_memdump_s)],
                ["CRIU write", fmt_s(t.criu_memwrite_s)],
                ["CRIU total", fmt_s(t.criu_total_s)],
                ["unlock", fmt_s(t.unlock_s)],
                ["publish (checksums, fsync, rename)", fmt_s(t.publish_s)],
            ],
        )
        out.kv(
            "summary",
            {
                "frozen": fmt_s(t.frozen_s),
                "total": fmt_s(t.total_s),
                "image size": human_bytes(m.bytes.image_bytes),
                "device memory": human_bytes(m.bytes.device_bytes),
                "original": "still running"
                if m.leave_running
                else f"gone (bring it back: npusnap restore {result.image})",
            },
        )
        if result.attached:
            out.line(f"agents were attached to pid(s) {', '.join(map(str, result.attached))}")
        if result.logs:
            out.line(f"CRIU logs kept in {result.logs}")
        out.result(result.to_dict())
