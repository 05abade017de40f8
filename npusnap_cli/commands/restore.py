"""`npusnap restore DIR`: bring back a process tree, device state included, from an image."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from npusnap_cli import criupass, image
from npusnap_cli.commands import jobcmd, jobcmd_restore
from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.commands._progress import ProgressBars, fmt_s, show_log
from npusnap_cli.commands.images import import_into
from npusnap_cli.errors import UsageError
from npusnap_cli.host import oplog, pidns, preflight
from npusnap_cli.pipelines import replicas as replicas_mod
from npusnap_cli.pipelines import restore as restore_mod
from npusnap_cli.pipelines import restorecheck
from npusnap_cli.pipelines.restore import RestoreOptions

if TYPE_CHECKING:
    from npusnap_cli.image import OpenedImage


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("restore"))
    def restore(
        ctx: typer.Context,
        # readable=False: click would call root's image a usage error (2); npusnap's own open
        # meets the EACCES and says that root is needed (3).
        directory: Path = typer.Argument(
            ...,
            readable=False,
            metavar="DIR",
            help="The image directory written by `npusnap dump` (with --import: the directory to "
            "import the archive into, new or empty).",
        ),
        import_from: Optional[Path] = typer.Option(
            None,
            "--import",
            "-i",
            metavar="FILE",
            help="First import this archive (`npusnap export`, `dump --export`) into DIR, verified, "
            "then restore DIR (as `npusnap import FILE DIR && npusnap restore DIR`; as `podman "
            "container restore -i`).",
        ),
        dry_run: bool = typer.Option(
            False,
            "--dry-run",
            help="Run every check the restore makes (image, checksums, versions, pids and devices "
            "free, sockets, files, pipes, logs) and list what it would need; touch nothing. Exit 0 "
            "when the restore would start, else the first problem's exit code.",
        ),
        no_verify: bool = typer.Option(
            False,
            "--no-verify",
            help="Skip the checksum check of the image's files (structure and sizes are still checked).",
        ),
        pidfile: Optional[Path] = typer.Option(
            None,
            "--pidfile",
            help="Write the restored root pid into this file (atomically; its directory is checked first).",
        ),
        logs: Optional[Path] = typer.Option(
            None,
            "--logs",
            help="Write CRIU's restore log here (default: DIR/logs, or a new directory under "
            "$TMPDIR/npusnap-logs when the image is on read-only storage).",
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
        tcp_close: bool = typer.Option(
            False,
            "--tcp-close",
            help="Restore the image's established TCP connections closed (CRIU's --tcp-close): for "
            "a copy beside its running original, which keeps them. --replicas does this always.",
        ),
        criu_opt: Optional[list[str]] = typer.Option(
            None, "--criu-opt", metavar="NAME[=VALUE]", help=criupass.help_text("restore")
        ),
        settle: float = typer.Option(
            0.5,
            "--settle",
            min=0.0,
            max=60.0,
            help="Seconds to watch the restored tree after it resumed; a process that died in "
            "that time fails the restore.",
        ),
        require_signature: Optional[Path] = typer.Option(
            None,
            "--require-signature",
            metavar="PUBKEYFILE",
            help="Refuse the image unless `dump --sign` signed it with the key of this Ed25519 "
            "public key (PEM).",
        ),
        accept_lost: bool = typer.Option(
            False,
            "--accept-lost-device-memory",
            help="Restore an image dumped with --device-memory discard: the job runs again with "
            "its device memory LOST (it must rebuild it). Refused without this flag.",
        ),
        rank_netns: Optional[list[str]] = typer.Option(
            None,
            "--rank-netns",
            help="Job images: restore rank RANK into the network namespace at PATH (RANK=PATH, "
            "repeatable); default: the namespace of the same name as at dump time, or ours.",
        ),
        coordinator: Optional[str] = typer.Option(
            None,
            "--coordinator",
            help="Across nodes: HOST:PORT of the job's coordinator, served by node 0's npusnap; "
            "run the same command on every node with its --node (docs/distributed.md).",
        ),
        node: int = typer.Option(0, "--node", min=0, help="This node's number (0 serves --coordinator)."),
        nodes: int = typer.Option(1, "--nodes", min=1, help="How many nodes take part (with --coordinator)."),
        wait: bool = typer.Option(
            False,
            "--wait",
            help="Stay the restored processes' parent until they exit (forwarding SIGTERM/SIGINT), "
            "and exit with the first non-zero exit code: e.g. inside `srun --overlap`, so that "
            "Slurm tracks the restored tasks.",
        ),
        lazy: bool = typer.Option(
            False,
            "--lazy",
            help="Restore host memory lazily (CRIU's lazy pages over userfaultfd): the job computes "
            "again before its memory is all back; the page files are verified while it runs. "
            "Returns once every page is in (docs/reference/restore.md).",
        ),
        lazy_timeout: float = typer.Option(
            600.0,
            "--lazy-timeout",
            min=1.0,
            help="With --lazy: seconds the page-in (and the page files' checksums) may take; past "
            "them the restored tree and the lazy-pages daemon are killed.",
        ),
        device_map: Optional[list[str]] = typer.Option(
            None,
            "--device-map",
            metavar="IMG=DEV[,IMG=DEV]",
            help="Restore onto other devices: the image's device IMG becomes device DEV (simulated "
            "NPU only; on a node, a container does this). With --replicas, once per replica.",
        ),
        output_file: Optional[Path] = typer.Option(
            None,
            "--output",
            "-o",
            help="The restored job writes where its standard output file was (stdout and stderr, "
            "usually) into this file instead (appended). With --replicas, {n} in it is the replica's "
            "number (else .N is appended); without it, each replica writes to that file's path plus "
            ".NAME (--replica-name), never into the original's.",
        ),
        replica_name: str = typer.Option(
            "replica-{n}",
            "--replica-name",
            metavar="TEMPLATE",
            help="With --replicas: each copy's name, {n} its number (e.g. 'trainer-{n}'); its CRIU "
            "logs go to LOGS/NAME and its output, by default, to the original output file's path "
            "plus .NAME.",
        ),
        replicas: int = typer.Option(
            1,
            "--replicas",
            min=1,
            help="Restore N copies side by side, at once, each in its own pid namespace (an image of "
            "`npusnap run --pid-ns`), each with its own --device-map, pidfile (--pidfile P: P.N, or "
            "{n} in P) and CRIU log directory.",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> Optional[int]:
        """Restore the process tree saved in DIR and its NPU device state; print the root pid on stdout.

        The image is verified first (schema, checksums, versions, pids and devices free): any
        problem is reported before anything is touched. CRIU then restores the tree, detached,
        and every NPU process gets its device state back and is unlocked. If that last step
        fails for a process, it stays locked and the error says how to retry.
        """

        out = output(ctx, "restore", json_flag)
        if not dry_run:
            # First: as a user, the image (root's) would be refused half-way with a bare EACCES.
            preflight.require_privileges("restore")
        bars = ProgressBars(out)
        if import_from is not None:
            if dry_run:
                raise UsageError(
                    "--dry-run does not import", fix=f"import first: npusnap import {import_from} {directory}"
                )

            import_into(out, import_from, directory, force=False)

        def phase(label: str) -> None:
            bars.close()
            out.info(f"… {label}")

        if no_verify:
            out.warn(
                "--no-verify: the files' checksums are not checked; a corrupted image would restore "
                f"a corrupted job (`npusnap verify {directory}` checks them)"
            )

        maps = [pidns.parse_device_map(m) for m in device_map or []]
        ref = image.open(directory)
        ref.refuse_restore()
        if replicas > 1:
            if dry_run:
                raise UsageError(
                    "--dry-run checks one restore, not --replicas",
                    fix="check one copy: npusnap restore DIR --dry-run --device-map ... (the first copy's)",
                )

            # What a restore imports, imported once here: each copy's restore runs in a child forked
            # from this process (replicas.py), which then starts no interpreter and imports nothing.
            import pycriu  # noqa: F401

            from npusnap_cli import cli, criu  # noqa: F401  # lazy: forked children inherit them
            from npusnap_cli.host import hostres, lazypages  # noqa: F401  # lazy: the same
            from npusnap_cli.pipelines import restoreguard  # noqa: F401  # lazy: the same

            cli.load_all()
            phase(f"restoring {replicas} replicas at once")
            results = replicas_mod.restore_all(
                ref.path,
                replicas,
                maps,
                verify=not no_verify,
                pidfile=pidfile,
                output=output_file,
                logs=logs,
                settle_s=settle,
                extra=[
                    "--tcp-close",
                    *(["--accept-lost-device-memory"] if accept_lost else []),
                    *(f"--criu-opt={o}" for o in criupass.parse(criu_opt or [], "restore")),
                ],
                main=cli.main,
                name=replica_name,
            )
            failed = replicas_mod.failure(results)
            rows = [
                [
                    str(r.index),
                    r.name,
                    str(r.root_pid or "-"),
                    "ok" if r.ok else "FAILED",
                    f"{r.wall_s:.3f}s",
                    r.output or "-",
                ]
                for r in results
            ]
            out.table(
                "replicas",
                ["replica", "name", "root pid", "status", "restore time", "output"],
                rows,
                stream="stderr",
            )
            if failed is not None:
                raise failed
            for r in results:
                out.data(str(r.root_pid))
            out.result({"image": str(directory), "replicas": [r.__dict__ for r in results]})
            return None
        if len(maps) > 1:
            raise UsageError("--device-map is given more than once without --replicas", fix="give it once")
        options = restore_mod.RestoreOptions(
            device_map=maps[0] if maps else (),
            output=output_file,
            verify=not no_verify,
            pidfile=pidfile,
            logs=logs,
            pipe_to=pipe_to,
            replace_tmpfs_files=replace_tmpfs_files,
            tcp_close=tcp_close,
            criu_passthrough=criupass.parse(criu_opt or [], "restore"),
            settle_s=settle,
            require_signature=require_signature,
            accept_lost_device_memory=accept_lost,
            lazy=lazy,
            lazy_timeout_s=lazy_timeout,
        )
        callbacks = restore_mod.RestoreCallbacks(phase=phase, progress=bars.update, note=out.warn)
        if dry_run:
            return _dry_run(out, ref, options)
        restore_mod.become_subreaper()
        if isinstance(ref, image.JobImage):
            if lazy:
                raise UsageError(
                    "--lazy is not supported for job images (several ranks) yet",
                    fix="restore the job image without --lazy",
                )
            if options.device_map or options.output is not None:
                raise UsageError(
                    "--device-map and --output are not supported for job images (several ranks) yet",
                    why="a job restore would otherwise put every rank back on its own devices and "
                    "files, silently ignoring them",
                    fix="restore the job image without them, or one rank's image on its own "
                    "(`npusnap restore DIR/rank-N --device-map ...`)",
                )

            try:
                with oplog.operation("restore", [], str(directory)) as op:
                    roots, data = jobcmd_restore.restore_job(
                        out,
                        ref.path,
                        options,
                        callbacks,
                        jobcmd.parse_rank_netns(rank_netns),
                        jobcmd.net_options(coordinator, node, nodes),
                    )
                    op.pids = list(roots)
            finally:
                bars.close()
            return jobcmd_restore.wait_and_report(out, roots, data, wait)
        if rank_netns or coordinator:
            raise UsageError("--rank-netns and --coordinator are for job images only", fix="drop them")
        try:
            with oplog.operation("restore", [], str(directory)) as op:
                result = restore_mod.restore(ref.path, options, callbacks)
                op.pids = list(result.pids)
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
                ["verify (structure, then checks)", fmt_s(t.verify_s)],
                ["CRIU restore (checksums alongside)", fmt_s(t.criu_restore_s)],
                ["waiting for the checksums", fmt_s(t.verify_wait_s)],
                ["device restore + unlock", fmt_s(t.device_restore_s)],
                ["total (the job computes again)", fmt_s(t.total_s)],
            ]
            + (
                [["lazy page-in complete (and page files verified)", fmt_s(t.lazy_complete_s)]]
                if t.lazy_complete_s is not None
                else []
            ),
            stream="stderr",
        )
        if result.lazy is not None:
            lz = result.lazy
            pages = "every page"
            if lz.pages_total:
                pages = f"{lz.pages_copied} of {lz.pages_total} pages"
            out.line(
                f"lazy restore complete: {pages} paged in by criu lazy-pages (log {lz.daemon_log}); "
                f"page files verified: {lz.pages_verified}"
            )
        if result.pidfile:
            out.line(f"pid written to {result.pidfile}")
        if result.criu_log:
            out.debug(f"CRIU's restore log: {result.criu_log}")

            show_log(out, Path(result.criu_log).parent)
        out.data(str(result.root_pid))

        return jobcmd_restore.wait_and_report(out, [result.root_pid], result.to_dict(), wait)


def _dry_run(out: object, ref: OpenedImage, options: RestoreOptions) -> int:
    """restore --dry-run: the table of checks; exit code of the first problem."""
    from typing import Any

    o: Any = out
    directory = ref.given
    images = [directory]
    if isinstance(ref, image.JobImage):
        images = [directory / r.dir for r in ref.job.ranks]
    results: list[dict[str, Any]] = []
    for one in images:
        for check in restorecheck.run_checks(one, options):
            results.append({"image": str(one), **check.to_dict()})
    o.table(
        f"npusnap restore --dry-run {directory}",
        ["image", "check", "status", "found"] if len(images) > 1 else ["check", "status", "found"],
        [
            ([Path(r["image"]).name] if len(images) > 1 else []) + [r["name"], r["status"], r["detail"]]
            for r in results
        ],
        styles=[{"problem": "red", "skipped": "dim"}.get(r["status"]) for r in results],
    )
    problems = [r for r in results if r["status"] == "problem"]
    for r in problems:
        fix = (r.get("error") or {}).get("fix")
        o.warn(f"{r['name']}: {r['detail']}" + (f" (fix: {fix})" if fix else ""))
    code = int(problems[0]["exit_code"]) if problems else 0
    if problems:
        o.line(f"✘ the restore would fail: {len(problems)} problem(s); nothing was touched", style="red")
    else:
        o.ok("the restore would start: every check passed; nothing was touched")
    o.result({"image": str(directory), "ready": not problems, "checks": results}, exit_code=code)
    return code
