"""`npusnap dump PID DIR`: snapshot a running NPU process tree (device state included) into DIR."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from npusnap_cli import criu, criupass
from npusnap_cli.commands import jobcmd, jobcmd_dump
from npusnap_cli.commands._common import JSON_HELP, clean_stale_sockets, epilog, output
from npusnap_cli.commands._progress import ProgressBars, dump_phase_rows, fmt_s, show_log
from npusnap_cli.errors import UsageError
from npusnap_cli.host import oplog
from npusnap_cli.image import archive, imagestore, layout
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.pipelines import dump as dump_mod
from npusnap_cli.pipelines import slurm
from npusnap_cli.units import human_bytes

if TYPE_CHECKING:
    from npusnap_cli.ui import Output


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("dump"))
    def dump(
        ctx: typer.Context,
        pids: Optional[list[int]] = typer.Argument(
            None,
            min=1,
            metavar="PID...",
            help="Root of the process tree to snapshot; several PIDs: one coordinated job image, "
            "one rank per PID (docs/distributed.md).",
        ),
        directory: Path = typer.Argument(
            ..., metavar="DIR", help="Image directory to create (new or empty)."
        ),
        leave_running: bool = typer.Option(
            False,
            "--leave-running",
            "-R",
            help="Keep the original running after the dump (as `criu dump -R`, `podman container "
            "checkpoint -R`).",
        ),
        export_to: Optional[Path] = typer.Option(
            None,
            "--export",
            "-e",
            metavar="FILE",
            help="After the dump, also write the image into this archive (tar + zstd, as `npusnap "
            "export`; as `podman container checkpoint -e`).",
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
        timeout: Optional[float] = typer.Option(
            None,
            "--timeout",
            min=1.0,
            help="Seconds CRIU may take to freeze the tree (CRIU's --timeout; whole seconds, rounded up).",
        ),
        keep: bool = typer.Option(
            False,
            "--keep",
            help="Accepted for old scripts: CRIU's log is always kept in the image (DIR/logs/dump.log).",
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
            "needed), iptables or skip. Default: skip for a tree in this host's network namespace "
            "without --tcp-established (CRIU would lock nothing), else nftables where CRIU has it.",
        ),
        criu_opt: Optional[list[str]] = typer.Option(
            None, "--criu-opt", metavar="NAME[=VALUE]", help=criupass.help_text("dump")
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
            help="Seconds each agent waits for npusnap before rolling its process back by itself "
            "(default 60: a dump holds the lock only while it runs itself; `freeze` defaults to 300 "
            "because a person or an external tool holds that one).",
        ),
        keep_last: Optional[int] = typer.Option(
            None,
            "--keep-last",
            min=1,
            help="After a successful dump, remove the oldest npusnap images next to DIR (in its parent) "
            "so that N remain; only complete npusnap image directories are ever removed.",
        ),
        latest: bool = typer.Option(
            False,
            "--latest",
            help="After a successful dump, point the symlink `latest` in DIR's parent at DIR (atomically).",
        ),
        sign: Optional[Path] = typer.Option(
            None,
            "--sign",
            metavar="KEYFILE",
            help="Sign the image's manifest with this Ed25519 private key (PEM), for "
            "`restore/verify --require-signature`.",
        ),
        device_memory: str = typer.Option(
            "preserve",
            "--device-memory",
            help="Who keeps the job's device memory (CANN's Restore does not): preserve (npusnap "
            "copies it; needs `npusnap run` or registered buffers), app (the application's hooks), "
            "discard (lost; restore refuses without --accept-lost-device-memory).",
        ),
        drain_timeout: Optional[float] = typer.Option(
            None,
            "--drain-timeout",
            min=0.1,
            max=600.0,
            metavar="SECONDS",
            help="How long each agent waits, after Lock, for its devices to finish their queued work "
            "(kernels, copies, collectives) before it copies their memory (default 10; 3 for a tree "
            "of several NPU processes, tried up to 6 times). A device still busy fails the attempt "
            "and the job runs on.",
        ),
        coordinator: Optional[str] = typer.Option(
            None,
            "--coordinator",
            help="Across nodes: HOST:PORT of the job's coordinator, served by node 0's npusnap; "
            "run the same command on every node with its --node (docs/distributed.md).",
        ),
        node: int = typer.Option(0, "--node", min=0, help="This node's number (0 serves --coordinator)."),
        nodes: int = typer.Option(1, "--nodes", min=1, help="How many nodes take part (with --coordinator)."),
        slurm_job: Optional[str] = typer.Option(
            None,
            "--slurm-job",
            help="Snapshot every task of this Slurm job on this node (scontrol listpids), one rank "
            "per task, as one job image (implies --shell-job). No PID then.",
        ),
        parent: Optional[Path] = typer.Option(
            None,
            "--parent",
            metavar="IMAGE",
            help="An earlier image of this job: device-memory chunks it holds are linked, not "
            "written again (images next to DIR are used too; docs/image-format.md).",
        ),
        dry_run: bool = typer.Option(
            False,
            "--dry-run",
            help="Run every check of the dump and say whether it would go ahead, without touching "
            "the job: no agent attached, no lock, no freeze, nothing written. A refusal exits "
            "with the code the dump would.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Snapshot PID's process tree, NPU device state included, into DIR.

        Every NPU process is locked and backed up in parallel, CRIU dumps the tree, and the image
        is renamed into place only when complete. By default the original tree is gone
        afterwards; with --leave-running it keeps running. Any failure rolls every process back
        (running, unlocked) and removes the partial image; the exit code names the failed stage.
        """

        if network_lock is not None and network_lock not in criu.NETWORK_LOCKS:
            raise UsageError(
                f"--network-lock {network_lock!r} is not a network lock method",
                fix=f"use one of: {', '.join(criu.NETWORK_LOCKS)}",
            )

        out = output(ctx, "dump", json_flag)
        clean_stale_sockets(out)
        bars = ProgressBars(out)

        def phase(label: str) -> None:
            bars.close()
            out.info(f"… {label}")

        options = dump_mod.DumpOptions(
            criu=criu.CriuOptions(
                leave_running=leave_running,
                tcp_established=tcp_established,
                shell_job=shell_job,
                file_locks=file_locks,
                ext_unix_sk=ext_unix_sk,
                external=tuple(external or ()),
                timeout=None if timeout is None else math.ceil(timeout),
                link_remap=link_remap,
                network_lock=network_lock,
                passthrough=criupass.parse(criu_opt or [], "dump"),
            ),
            keep=True,
            force=force,
            attach=not no_attach,
            lease_s=lease,
            external_pipes=external_pipes,
            sign_key=sign,
            device_memory=device_memory,
            drain_timeout_s=drain_timeout,
            parent=None if parent is None else _parent_image(parent),
        )
        callbacks = dump_mod.DumpCallbacks(phase=phase, progress=bars.update, note=out.warn)
        pids = list(pids or [])
        net = jobcmd.net_options(coordinator, node, nodes)
        if slurm_job is not None:
            if pids:
                raise UsageError(
                    "--slurm-job and PIDs are exclusive", fix="give either PIDs or --slurm-job JOBID"
                )
            tasks = slurm.job_tasks(slurm_job)
            out.info(
                f"Slurm job {slurm_job}: "
                + ", ".join(f"task {t.global_id} (step {t.step}) pid {t.pid}" for t in tasks)
            )
            pids = [t.pid for t in tasks]
            # Tasks share slurmstepd's session and the first task's process group.
            options = dataclasses.replace(options, criu=dataclasses.replace(options.criu, shell_job=True))
        if not pids:
            raise UsageError(
                "no PID given",
                fix="npusnap dump PID [PID...] DIR, or --slurm-job JOBID DIR (see `npusnap dump --help`)",
            )
        if dry_run:
            if len(pids) > 1 or slurm_job is not None or net is not None:
                raise UsageError(
                    "--dry-run checks the dump of one process tree",
                    fix="run it for each PID of the job: npusnap dump --dry-run PID DIR",
                )
            checked = dump_mod.dry_run(pids[0], directory, options, callbacks)
            _show_dry_run(out, checked)
            if checked.exit_code:
                raise typer.Exit(checked.exit_code)
            return
        if len(pids) > 1 or slurm_job is not None or net is not None:
            # A job image (a one-task Slurm job, or one node's part of a job, too).
            if keep_last is not None or latest or export_to is not None:
                raise UsageError(
                    "--keep-last, --latest and --export are for single images",
                    fix="drop them for a job dump (`npusnap export` takes a job image afterwards)",
                )
            with oplog.operation("dump", pids, str(directory)):
                jobcmd_dump.dump_job(out, pids, directory, options, callbacks, net)
            return
        pid = pids[0]
        try:
            with oplog.operation("dump", [pid], str(directory)):
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
            [*dump_phase_rows(t), ["publish (checksums, fsync, rename)", fmt_s(t.publish_s)]],
            stream="stderr",
        )
        out.kv(
            "summary",
            {
                "frozen": fmt_s(t.frozen_s),
                **(
                    {"stopped by attach": f"{fmt_s(t.attach_stopped_s)} (at most; before the freeze)"}
                    if t.attach_stopped_s is not None
                    else {}
                ),
                "total": fmt_s(t.total_s),
                "image size": human_bytes(m.bytes.image_bytes),
                "device memory": human_bytes(m.bytes.device_bytes),
                "device memory kept by": {
                    "npusnap": "npusnap (copied after Lock, written back at restore)",
                    "application": "the application's hooks (--device-memory app)",
                    "lost": "nobody: DISCARDED (--device-memory discard)",
                }.get(str(m.device_memory.get("continuity")), "-"),
                "original": "still running"
                if m.leave_running
                else f"gone (bring it back: npusnap restore {result.image})",
            },
            stream="stderr",
        )
        if result.attached:
            stops = dict(result.attach_stopped_s)
            out.line(
                "agents were attached to pid(s) "
                + ", ".join(
                    f"{p} (stopped {stops[p]:.3f}s at most)" if p in stops else str(p)
                    for p in result.attached
                )
            )
        if result.logs:
            out.line(f"CRIU's log: {result.logs}")
            show_log(out, Path(result.logs))
        data = result.to_dict()
        data.update(_manage(out, Path(result.image), keep_last, latest))
        data["export"] = _export(out, Path(result.image), export_to) if export_to is not None else None
        out.data(result.image)
        out.result(data)


def _show_dry_run(out: Output, result: dump_mod.DryRunOutcome) -> None:
    """dump --dry-run: the table of checks, as restore --dry-run shows its own; exit code of the
    first problem."""
    rows = result.results
    out.table(
        f"npusnap dump --dry-run {result.image}",
        ["check", "status", "found"],
        [[r.name, r.status, r.detail] for r in rows],
        styles=[{"problem": "red", "skipped": "dim"}.get(r.status) for r in rows],
    )
    problems = [r for r in rows if r.status == "problem"]
    for r in problems:
        fix = (r.error or {}).get("fix")
        out.warn(f"{r.name}: {r.detail}" + (f" (fix: {fix})" if fix else ""))
    if problems:
        out.line(f"✘ the dump would fail: {len(problems)} problem(s); nothing was touched", style="red")
    elif result.would_attach:
        out.ok(
            "the dump would start: every check passed; it would attach an agent to pid(s) "
            f"{', '.join(map(str, result.would_attach))} and ask it then; nothing was touched"
        )
    else:
        out.ok("the dump would start: every check passed; nothing was touched")
    out.result(result.to_dict(), exit_code=result.exit_code)


def _export(out: Output, image: Path, target: Path) -> JSONObject:
    """--export: the archive of the image just written (as `npusnap export IMAGE FILE`)."""

    bars = ProgressBars(out)
    done = [0]
    total = sum(f.stat().st_size for f in image.rglob("*") if f.is_file())

    def advance(n: int) -> None:
        done[0] += n
        bars.update("exporting", done[0], max(total, done[0]))

    try:
        result = archive.export(image, target, level=3, threads=-1, force=False, progress=advance)
    finally:
        bars.close()
    out.ok(f"exported to {result.archive} ({human_bytes(result.bytes_out)})")
    return result.to_dict()


def _manage(out: Output, image: Path, keep_last: Optional[int], latest: bool) -> JSONObject:
    """--latest and --keep-last, after the image is complete (the pointer first: rotation never
    removes what `latest` names)."""

    pointer: Optional[str] = None
    removed: list[str] = []
    # Every image this command publishes is noted as ours, so that a later --keep-last can tell
    # it from a look-alike another user put beside it.
    imagestore.record_own(image)
    if latest:
        pointer = imagestore.update_latest(image)
        out.line(f"{pointer} -> {image.name}")
    if keep_last is not None:
        removed = imagestore.rotate(image.parent, keep_last, keep=image)
        for path in removed:
            out.line(f"removed old image {path} (--keep-last {keep_last})")
    return {"latest": pointer, "removed": removed}


def _parent_image(path: Path) -> Path:
    """--parent: an image directory (a `latest` pointer is followed), or a usage error."""

    target = layout.follow_pointer(path)
    if not (target.is_dir() and layout.manifest_path(target).is_file()):
        raise UsageError(
            f"--parent {path}: not an npusnap image",
            fix="name an image directory written by `npusnap dump` (or drop --parent)",
        )
    return target
