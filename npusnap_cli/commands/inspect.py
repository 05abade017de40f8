"""`npusnap inspect DIR` (show an image's manifest) and `npusnap verify DIR` (check it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import typer

from npusnap_cli import image
from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.commands._progress import dump_phase_rows, fmt_s
from npusnap_cli.errors import NpusnapError
from npusnap_cli.image import criudetail, k8sjob, layout
from npusnap_cli.image.manifest import ProcessEntry, load_manifest
from npusnap_cli.units import human_bytes

DIR_HELP = (
    "An image directory (`npusnap dump`) or archive (`npusnap export`), or a container checkpoint "
    "made through npusnap's CRIU plugin (its directory or export archive)."
)


def _job_row(job: Any) -> dict[str, str]:
    """The plugin's record of the job it joined (`npusnap k8s checkpoint`), if any."""
    if not job:
        return {}
    return {"job member": f"{job.get('member')} (coordinator {job.get('coordinator')})"}


def _host_needs(out: Any, manifest: Any) -> None:
    """What a restore needs from the host besides the image's own files."""
    rows = [[n.path, n.kind, f"{n.mode:o}", f"{n.uid}:{n.gid}", n.why] for n in manifest.host_nodes]
    rows += [
        [f.path, "file (in the image)", f"{f.mode:o}", f"{f.uid}:{f.gid}", "tmpfs / deleted file"]
        for f in manifest.host_files
    ]
    if rows:
        out.table("needed on the host at restore", ["path", "kind", "mode", "owner", "for"], rows)


def criu_detail(path: Path, *, archive: bool = False, container: Any = None) -> Any:
    """What CRIU saved (files, sockets, mounts, statistics) for an image directory, an archive
    (``archive``) or a container checkpoint (``container``: its PluginCheckpoint); None when its
    CRIU images cannot be read (never fails the inspect)."""

    try:
        if container is not None:
            if container.form == "archive":
                return criudetail.describe_archive(path, container=True, prefix=container.prefix)
            where = path / container.prefix if container.prefix else path
            return criudetail.describe(where, where)
        if archive:
            return criudetail.describe_archive(path, container=False)
        return criudetail.describe(layout.criu_dir(path), layout.logs_dir(path))
    except (OSError, NpusnapError):
        return None


@dataclass(frozen=True)
class Sections:
    """What `inspect` prints as text, chosen as checkpointctl's filters choose (`--ps-tree`,
    `--files`, `--sockets`, `--mounts`, `--stats`, `--all`). The default is short: the summary
    and the process tree, with counts of the rest. JSON always carries everything."""

    ps_tree: bool = True
    files: bool = False
    sockets: bool = False
    mounts: bool = False
    stats: bool = False

    @classmethod
    def chosen(
        cls, *, ps_tree: bool, files: bool, sockets: bool, mounts: bool, stats: bool, all_: bool
    ) -> Sections:
        if all_:
            return ALL_SECTIONS
        if not (ps_tree or files or sockets or mounts or stats):
            return cls()
        return cls(ps_tree=ps_tree, files=files, sockets=sockets, mounts=mounts, stats=stats)

    @property
    def short(self) -> bool:
        return self == Sections()


ALL_SECTIONS = Sections(ps_tree=True, files=True, sockets=True, mounts=True, stats=True)


def show_criu_detail(out: Any, detail: Any, label: str = "", sections: Sections = ALL_SECTIONS) -> None:
    """The files, sockets, mounts and CRIU statistics tables (as checkpointctl shows them)."""

    if detail is None:
        if sections.files or sections.sockets or sections.mounts or sections.stats or sections.short:
            out.warn(f"{label}CRIU's images could not be read: no files, sockets or statistics to show")
        return
    files = detail["files"]
    socks = detail["sockets"]
    mounts = detail["mounts"]
    if sections.short:
        out.line(
            f"{label}CRIU saved {len(files)} open file(s), {len(socks)} socket(s), {len(mounts)} mount(s): "
            "`--files`, `--sockets`, `--mounts`, `--stats` show them (`--all`: everything)"
        )
        return
    if sections.files:
        out.table(
            f"{label}open files",
            ["pid", "fd", "type", "path", "offset"],
            [
                [f["pid"], f["fd"], f["type"], f["name"], f.get("pos") if f.get("pos") is not None else "-"]
                for f in files
            ],
        )
    if not sections.sockets:
        pass
    elif socks:
        out.table(
            f"{label}sockets",
            ["pid", "fd", "family", "type", "address", "state"],
            [
                [
                    k["pid"],
                    k["fd"],
                    k.get("family", "?"),
                    k.get("socket_type", "?"),
                    k.get("name", "-") + (f" (peer {k['peer']})" if k.get("peer") else ""),
                    k.get("state", "-"),
                ]
                for k in socks
            ],
        )
    else:
        out.line(f"{label}sockets: none")
    if not sections.mounts:
        pass
    elif mounts:
        out.table(
            f"{label}mounts",
            ["mount point", "type", "source", "external"],
            [
                [m["mountpoint"], m["fstype"], m["source"] or "-", "yes" if m["external"] else ""]
                for m in mounts
            ],
        )
    else:
        out.line(f"{label}mounts: none saved (the tree shares its mount namespace with the host)")
    st = detail.get("stats")
    if not sections.stats:
        pass
    elif st:
        ms = 1000.0

        def us(key: str) -> str:
            return f"{int(st.get(key, 0)) / ms:.1f} ms"

        out.kv(
            f"{label}CRIU statistics (stats-dump)",
            {
                "pages scanned": f"{st.get('pages_scanned', 0)} ({human_bytes(st.get('bytes_scanned', 0))})",
                "pages written": f"{st.get('pages_written', 0)} ({human_bytes(st.get('bytes_written', 0))})",
                "pages skipped (parent image)": st.get("pages_skipped_parent", 0),
                "pages left for lazy restore": st.get("pages_lazy", 0),
                "freezing time": us("freezing_time"),
                "frozen time": us("frozen_time"),
                "memory dump time": us("memdump_time"),
                "memory write time": us("memwrite_time"),
            },
        )
    else:
        out.line(
            f"{label}CRIU statistics: not here (an archive carries the image's files, not its logs/; "
            "an image dumped by an older npusnap kept them only with --keep)"
        )


def _show_k8s_job(out: Any, ref: image.K8sJobImage, sections: Sections) -> None:
    """A directory written by `npusnap k8s checkpoint`: its manifest and one archive per member."""

    directory = ref.path
    manifest = k8sjob.read_manifest(directory)
    out.kv(
        f"job checkpoint {directory} (npusnap k8s checkpoint)",
        {
            "created": manifest["created"],
            "coordinator": manifest["coordinator"],
            "barriers": ", ".join(manifest["barriers"]) or "none (one container)",
        },
    )
    out.table(
        "members",
        ["member", "container", "node", "archive", "sha256"],
        [
            [
                m["member"],
                f"{m['namespace']}/{m['pod']}/{m['container']}",
                m["node"],
                m["archive"],
                (m["sha256"] or "on its node")[:16],
            ]
            for m in manifest["members"]
        ],
    )
    out.result({"directory": str(directory), **manifest})


def _show_container(out: Any, ref: image.ContainerImage, sections: Sections) -> None:
    """A checkpoint written by npusnap's CRIU plugin (podman, CRI-O, containerd, plain criu)."""

    directory, ckpt = ref.path, ref.container
    summary: Any = ckpt.summary()  # free-form JSON of the plugin's record, shown as it is
    out.kv(
        f"container checkpoint {directory} (written by npusnap's CRIU plugin)",
        {
            "created": summary["created"],
            "host": summary["hostname"],
            "form": summary["form"] + (f", CRIU images under {ckpt.prefix}" if ckpt.prefix else ""),
            "engine": summary["engine"],
            **{f"container {k}": v for k, v in summary["container"].items()},
            **_job_row(summary["job"]),
            "image size": human_bytes(summary["image_bytes"]),
            "agent lease": f"{summary['lease_s']}s",
        },
    )
    if sections.ps_tree:
        out.table(
            "NPU processes (locked and backed up by the plugin)",
            ["pid at dump", "pid in its namespace", "agent socket"],
            [[p["pid"], p["ns_pid"], p["agent_socket"]] for p in summary["processes"]],
        )
    detail = criu_detail(directory, container=ckpt)
    show_criu_detail(out, detail, sections=sections)
    out.line(f"{summary['files']} files, run `npusnap verify {directory}` to check them")
    out.result({**summary, "criu": detail})


def _show_image(out: Any, ref: Union[image.DirectoryImage, image.ArchiveImage], sections: Sections) -> None:
    """An image directory or archive: its manifest, process tree, timings and what CRIU saved."""

    directory = ref.path
    manifest = ref.manifest
    data = {"image": str(directory), **manifest.to_dict()}
    v = manifest.versions
    out.kv(
        f"image {directory}",
        {
            "created": manifest.created_at,
            "host": f"{manifest.host.hostname} (kernel {manifest.host.kernel}, {manifest.host.machine})",
            "npusnap": v.tool,
            "CRIU": v.criu,
            "CANN": f"{v.cann or 'unknown'}{' (simulated NPU)' if v.cann_simulated else ''}",
            "root pid": manifest.root_pid,
            "original left running": "yes" if manifest.leave_running else "no",
            "image size": human_bytes(manifest.bytes.image_bytes),
            "device bytes": human_bytes(manifest.bytes.device_bytes),
        },
    )
    by_parent: dict[int, list[ProcessEntry]] = {}
    pids = {p.pid for p in manifest.processes}
    roots = []
    for p in manifest.processes:
        if p.ppid in pids:
            by_parent.setdefault(p.ppid, []).append(p)
        else:
            roots.append(p)
    nodes: list[tuple[int, str]] = []

    def walk(p: ProcessEntry, depth: int) -> None:
        cmd = " ".join(p.cmdline) or ("(zombie)" if p.zombie else "")
        npu = (
            f"  [NPU: device {','.join(map(str, p.devices)) or '?'}, {human_bytes(p.device_bytes)}]"
            if p.npu
            else (" [agent]" if p.agent else "")
        )
        nodes.append((depth, f"{p.pid}  {cmd}{npu}"))
        for child in by_parent.get(p.pid, []):
            walk(child, depth + 1)

    for r in roots:
        walk(r, 0)
    if sections.ps_tree:
        out.tree("processes", nodes)
    t = manifest.timings
    # No "publish" row: the manifest is written during publishing, so it cannot hold that
    # phase's time (`npusnap dump --json` reports it).
    if sections.stats:
        out.table(
            "timings",
            ["phase", "time"],
            [
                *dump_phase_rows(t),
                ["frozen (first lock to end)", fmt_s(t.frozen_s)],
                ["stopped by the dump's attach (at most)", fmt_s(t.attach_stopped_s)],
                ["total", fmt_s(t.total_s)],
            ],
        )
    _host_needs(out, manifest)

    data["criu"] = criu_detail(directory, archive=isinstance(ref, image.ArchiveImage))
    show_criu_detail(out, data["criu"], sections=sections)
    out.line(f"{len(manifest.files)} files, run `npusnap verify {directory}` to check them")
    out.result(data)


def _inspect_job(out: Any, ref: image.JobImage, sections: Sections) -> None:

    directory = ref.path
    job = ref.job
    rows = []
    ranks = []
    for r in job.ranks:
        m = load_manifest(Path(directory) / r.dir)
        rows.append(
            [
                str(r.rank),
                f"{r.dir}/",
                str(r.pid),
                " ".join(map(str, r.npu_pids)),
                ",".join(str(d) for p in m.npu_processes for d in p.devices) or "-",
                r.netns_path or r.netns or "(npusnap's)",
                human_bytes(m.bytes.image_bytes),
            ]
        )
        ranks.append({**r.to_dict(), "manifest": m.to_dict(), "criu": criu_detail(Path(directory) / r.dir)})
    out.kv(
        f"job image {directory}",
        {
            "created": job.created_at,
            "npusnap": job.tool,
            "ranks": len(job.ranks),
            "originals left running": "yes" if job.leave_running else "no",
        },
    )
    out.table("ranks", ["rank", "image", "pid", "NPU pids", "devices", "network namespace", "size"], rows)
    for r, data in zip(job.ranks, ranks):
        show_criu_detail(out, data["criu"], label=f"rank {r.rank}: ", sections=sections)
    out.line(
        f"each rank is an ordinary image (`npusnap inspect {directory}/rank-0`); "
        f"check the whole job: `npusnap verify {directory}`"
    )
    out.result({"image": str(directory), "job": job.to_dict(), "ranks": ranks})


# One renderer per kind of image (image/opened.py's KINDS): a new kind adds its line here.
_SHOW: dict[type[image.OpenedImage], Callable[[Any, Any, Sections], None]] = {
    image.K8sJobImage: _show_k8s_job,
    image.ContainerImage: _show_container,
    image.JobImage: _inspect_job,
    image.ArchiveImage: _show_image,
    image.DirectoryImage: _show_image,
}


def register(app: typer.Typer) -> None:
    @app.command("inspect", epilog=epilog("inspect"))
    def inspect_cmd(
        ctx: typer.Context,
        # readable=False: click would call root's image a usage error (2); npusnap's own open
        # meets the EACCES and says that root is needed (3).
        directory: Path = typer.Argument(
            ...,
            readable=False,
            metavar="DIR",
            help=DIR_HELP,
        ),
        ps_tree: bool = typer.Option(False, "--ps-tree", help="Show the process tree (shown by default)."),
        files: bool = typer.Option(False, "--files", help="Show the open files CRIU saved."),
        sockets: bool = typer.Option(False, "--sockets", help="Show the sockets CRIU saved."),
        mounts: bool = typer.Option(False, "--mounts", help="Show the mounts CRIU saved."),
        stats: bool = typer.Option(
            False, "--stats", help="Show the dump's per-phase timings and CRIU's statistics."
        ),
        all_: bool = typer.Option(False, "--all", help="Show everything (all of the above)."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Show what an image holds: by default the summary (versions, sizes, devices) and the
        process tree, with counts of what CRIU saved; --files, --sockets, --mounts and --stats
        show those (as checkpointctl's filters do), --all everything. --json always has all."""

        out = output(ctx, "inspect", json_flag)
        sections = Sections.chosen(
            ps_tree=ps_tree, files=files, sockets=sockets, mounts=mounts, stats=stats, all_=all_
        )
        ref = image.open(directory)
        _SHOW[type(ref)](out, ref, sections)

    @app.command("verify", epilog=epilog("verify"))
    def verify_cmd(
        ctx: typer.Context,
        directory: Path = typer.Argument(
            ...,
            readable=False,
            metavar="DIR",
            help=DIR_HELP,
        ),
        no_checksums: bool = typer.Option(
            False, "--no-checksums", help="Check only the structure and file sizes, not the checksums."
        ),
        require_signature: Optional[Path] = typer.Option(
            None,
            "--require-signature",
            metavar="PUBKEYFILE",
            help="Fail unless `dump --sign` signed the image with the key of this Ed25519 public key (PEM).",
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Check an image: trust (only regular files, owner and modes, manifest schema and
        self-hash, the signature with --require-signature), every file present with its size
        and checksum (BLAKE3; sha256 in images made before 2026-12).

        Exits non-zero (the image error code) on any mismatch and names the file.
        """

        out = output(ctx, "verify", json_flag)
        ref = image.open(directory)
        total = ref.verify_bytes()
        if total:
            with out.progress("verifying", total) as bar:
                result = ref.verify(
                    checksums=not no_checksums, require_signature=require_signature, progress=bar.advance
                )
        else:
            result = ref.verify(checksums=not no_checksums, require_signature=require_signature)
        for left in result.leftovers:
            out.warn(
                f"{left}: left by an interrupted dump (the next `npusnap dump` to {ref.path} cleans it up)"
            )
        for note in result.notes:
            out.line(note)
        if result.on_stdout:
            out.data(result.summary)
        else:
            out.ok(result.summary)
        out.result(result.record)
