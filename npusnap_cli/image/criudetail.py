"""What CRIU saved, read from its images (criuimages.py): open files, sockets, mounts and CRIU's own
statistics (pages scanned and written, freeze times), per process, as checkpointctl shows them.

Read only, never trusted for anything but display: a field that does not decode is left out.
Core module: never prints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, ParamSpec, TypeVar

from npusnap_cli import criu, criuimages
from npusnap_cli.image import archive, containers
from npusnap_cli.jsontypes import JSONObject, as_int

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SOCKET_TYPES = {1: "stream", 2: "dgram", 5: "seqpacket", 3: "raw"}
TCP_STATES = {1: "ESTABLISHED", 7: "CLOSE", 10: "LISTEN", 2: "SYN_SENT", 3: "SYN_RECV", 8: "CLOSE_WAIT"}
FAMILIES = {2: "inet", 10: "inet6", 1: "unix"}
SOCKET_KINDS = {"UNIXSK", "INETSK", "NETLINKSK", "PACKETSK"}


T = TypeVar("T")
P = ParamSpec("P")


def _read(read: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Optional[T]:
    """``read(*args)``, None for an image missing or one that does not decode: never fatal here."""
    try:
        return read(*args, **kwargs)
    except (OSError, criuimages.Undecodable):
        return None


def _unix_name(name: bytes) -> str:
    """A unix socket's name up to its first NUL (an abstract name shows as unnamed)."""
    return os.fsdecode(name.split(b"\0", 1)[0]) or "(unnamed)"


def _addr(family: int, addr: tuple[int, ...], port: int) -> str:
    try:
        if family == 2 and addr:
            ip = criuimages.inet_address(family, addr[:1])
        elif family == 10 and len(addr) >= 4:
            ip = "[" + criuimages.inet_address(family, addr[:4]) + "]"
        else:
            ip = "?"
    except (ValueError, OverflowError):
        ip = "?"
    return f"{ip}:{port}"


def _describe_file(entry: criuimages.FileEntry) -> JSONObject:
    """One files.img entry as {"type", "name", ...}."""
    kind = entry.type
    if kind == "REG":
        reg = entry.reg
        if reg is None:
            return {"type": "file", "name": "?", "pos": None, "size": None}
        return {"type": "file", "name": reg.name, "pos": reg.pos, "size": reg.size}
    if kind == "UNIXSK" and entry.usk is not None:
        usk = entry.usk
        state = "listening" if usk.state == 10 else ("connected" if usk.peer else "unconnected")
        return {
            "type": "socket",
            "family": "unix",
            "socket_type": SOCKET_TYPES.get(usk.type, str(usk.type)),
            "name": _unix_name(usk.name),
            "state": state,
            "peer_inode": usk.peer or None,
        }
    if kind == "INETSK" and entry.isk is not None:
        isk = entry.isk
        src = _addr(isk.family, isk.src_addr, isk.src_port)
        dst = _addr(isk.family, isk.dst_addr, isk.dst_port)
        return {
            "type": "socket",
            "family": FAMILIES.get(isk.family, str(isk.family)),
            "socket_type": SOCKET_TYPES.get(isk.type, str(isk.type)),
            "name": f"{src} -> {dst}" if isk.dst_port else src,
            "state": TCP_STATES.get(isk.state, str(isk.state)),
        }
    if kind in ("NETLINKSK", "PACKETSK"):
        return {"type": "socket", "family": kind[:-2].lower(), "socket_type": "-", "name": "-", "state": "-"}
    if kind == "PIPE":
        return {"type": "pipe", "name": f"pipe:[{'?' if entry.pipe_id is None else entry.pipe_id}]"}
    if kind == "TTY":
        return {"type": "tty", "name": "tty index ?"}  # files.img has no index (tty-info.img has)
    return {"type": kind.lower(), "name": "-"}


def describe(criu_dir: Path, stats_dir: Optional[Path] = None) -> JSONObject:
    """``{"processes", "files", "sockets", "mounts", "stats"}`` of one CRIU images directory;
    ``stats_dir``: where CRIU's ``stats-dump`` is (npusnap keeps it in the image's ``logs/``)."""
    files_by_id = {f.id: f for f in _read(criuimages.files, criu_dir) or []}
    # A connected unix socket names its peer by inode: show the peer's path when it has one.
    unix_names = {f.usk.ino: _unix_name(f.usk.name) for f in files_by_id.values() if f.usk is not None}
    tree = _read(criuimages.pstree, criu_dir) or []
    # Rows for display (and `inspect --json`): a file's and a socket's keys depend on their kind.
    processes: list[JSONObject] = []
    files: list[JSONObject] = []
    sockets: list[JSONObject] = []
    mounts: list[JSONObject] = []
    mount_ns: set[int] = set()
    for task in tree:
        pid = task.pid
        ids = _read(criuimages.ids, criu_dir, pid)
        if ids is not None and ids.mnt_ns_id:
            mount_ns.add(ids.mnt_ns_id)
        fds = (_read(criuimages.fdinfo, criu_dir, ids.files_id) if ids is not None else None) or []
        processes.append({"pid": pid, "ppid": task.ppid, "threads": list(task.threads), "fds": len(fds)})
        for fd in fds:
            entry = files_by_id.get(fd.id)
            described = _describe_file(entry) if entry else {"type": fd.type.lower(), "name": "-"}
            row: JSONObject = {"pid": pid, "fd": fd.fd, **described}
            peer = as_int(described.get("peer_inode"))
            if peer and unix_names.get(peer, "(unnamed)") != "(unnamed)":
                row["peer"] = unix_names[peer]
            (sockets if described["type"] == "socket" else files).append(row)
    for ns in sorted(mount_ns):
        for m in _read(criuimages.mounts, criu_dir, ns) or []:
            mounts.append(
                {
                    "mount_ns": ns,
                    "mountpoint": m.mountpoint,
                    "fstype": m.fstype,
                    "source": m.source,
                    "root": m.root,
                    "external": bool(m.ext_key or m.ext_mount),
                }
            )
    return {
        "processes": processes,
        "files": files,
        "sockets": sockets,
        "mounts": mounts,
        "stats": dump_stats(stats_dir) if stats_dir is not None else None,
    }


def dump_stats(directory: Path) -> Optional[dict[str, int]]:
    """CRIU's dump statistics (``stats-dump``), with bytes beside the page counts."""
    raw = None
    with contextlib.suppress(Exception):
        raw = criu.load_stats(str(directory), criu.STATS_DUMP_FILE)
    if not raw:
        return None
    out = dict(raw)
    for key in ("pages_scanned", "pages_written", "pages_skipped_parent", "pages_lazy", "page_pipes"):
        if key in raw and key != "page_pipes":
            out[key.replace("pages_", "bytes_")] = int(raw[key]) * PAGE
    return out


SMALL = 16 << 20  # metadata images; page files (pages-*.img) are never read here


def _wanted(name: str, size: int) -> Optional[str]:
    base = name.rsplit("/", 1)[-1]
    if base == "stats-dump":
        return "stats"
    if base.endswith(".img") and not base.startswith("pages-") and size <= SMALL:
        return "criu"
    return None


def describe_archive(path: Path, *, container: bool, prefix: str = "") -> JSONObject:
    """describe() of an archive (npusnap export, or a container checkpoint's export), read as a
    stream: only CRIU's small metadata images and the statistics are copied out, to a private
    temporary directory that is removed afterwards."""
    import shutil
    import tarfile
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="npusnap-inspect-"))
    try:
        (work / "criu").mkdir()
        (work / "stats").mkdir()
        if container:
            opener: Any = containers._open_archive(path)
        else:
            opener = archive._members(path)
        with opener as source:
            members = (
                ((m, source.extractfile(m) if m.isfile() else None) for m in source)
                if isinstance(source, tarfile.TarFile)
                else source
            )
            for member, fh in members:
                if fh is None or (prefix and not member.name.lstrip("./").startswith(prefix)):
                    continue
                where = _wanted(member.name, member.size)
                if where is None:
                    continue
                target = work / where / member.name.rsplit("/", 1)[-1]
                with open(target, "wb") as out:
                    shutil.copyfileobj(fh, out)
        return describe(work / "criu", work / "stats")
    finally:
        shutil.rmtree(work, ignore_errors=True)
