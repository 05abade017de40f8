"""What CRIU saved, read from its images (criuimages.py): open files, sockets, mounts and CRIU's own
statistics (pages scanned and written, freeze times), per process, as checkpointctl shows them.

Read only, never trusted for anything but display: a field that does not decode is left out.
Core module: never prints.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criu, criuimages
from npusnap_cli.image import archive, containers

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SOCKET_TYPES = {1: "stream", 2: "dgram", 5: "seqpacket", 3: "raw"}
TCP_STATES = {1: "ESTABLISHED", 7: "CLOSE", 10: "LISTEN", 2: "SYN_SENT", 3: "SYN_RECV", 8: "CLOSE_WAIT"}
FAMILIES = {2: "inet", 10: "inet6", 1: "unix"}
SOCKET_KINDS = {"UNIXSK", "INETSK", "NETLINKSK", "PACKETSK"}


def _load(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        return criuimages.load(path)
    except (OSError, criuimages.Undecodable):
        return None  # an image pycriu cannot decode: shown as missing, never fatal


def _entries(path: Path) -> list[dict[str, Any]]:
    data = _load(path)
    return list(data.get("entries") or []) if data else []


def _unix_name(name: Any) -> str:
    text = str(name or "")
    # pycriu shows the bytes of a name followed by "=" and their hex (e.g. "/run/x.sock=00").
    if "=" in text:
        text = text.rsplit("=", 1)[0]
    return text or "(unnamed)"


def _addr(family: int, addr: list[int], port: int) -> str:
    import ipaddress

    try:
        if family == 2 and addr:
            ip = str(ipaddress.IPv4Address(int(addr[0]).to_bytes(4, "little")))
        elif family == 10 and len(addr) >= 4:
            ip = (
                "["
                + str(ipaddress.IPv6Address(b"".join(int(a).to_bytes(4, "little") for a in addr[:4])))
                + "]"
            )
        else:
            ip = "?"
    except (ValueError, OverflowError):
        ip = "?"
    return f"{ip}:{port}"


def _describe_file(entry: dict[str, Any]) -> dict[str, Any]:
    """One files.img entry as {"type", "name", ...}."""
    kind = entry.get("type", "?")
    if kind == "REG":
        reg = entry.get("reg") or {}
        return {"type": "file", "name": reg.get("name", "?"), "pos": reg.get("pos"), "size": reg.get("size")}
    if kind == "UNIXSK":
        usk = entry.get("usk") or {}
        state = "listening" if usk.get("state") == 10 else ("connected" if usk.get("peer") else "unconnected")
        return {
            "type": "socket",
            "family": "unix",
            "socket_type": SOCKET_TYPES.get(usk.get("type", 0), str(usk.get("type"))),
            "name": _unix_name(usk.get("name")),
            "state": state,
            "peer_inode": usk.get("peer") or None,
        }
    if kind == "INETSK":
        isk = entry.get("isk") or {}
        family = int(isk.get("family", 0))
        src = _addr(family, list(isk.get("src_addr") or []), int(isk.get("src_port", 0)))
        dst = _addr(family, list(isk.get("dst_addr") or []), int(isk.get("dst_port", 0)))
        return {
            "type": "socket",
            "family": FAMILIES.get(family, str(family)),
            "socket_type": SOCKET_TYPES.get(isk.get("type", 0), str(isk.get("type"))),
            "name": f"{src} -> {dst}" if isk.get("dst_port") else src,
            "state": TCP_STATES.get(isk.get("state", 0), str(isk.get("state"))),
        }
    if kind in ("NETLINKSK", "PACKETSK"):
        return {"type": "socket", "family": kind[:-2].lower(), "socket_type": "-", "name": "-", "state": "-"}
    if kind == "PIPE":
        return {"type": "pipe", "name": f"pipe:[{(entry.get('pipe') or {}).get('pipe_id', '?')}]"}
    if kind == "TTY":
        return {"type": "tty", "name": f"tty index {(entry.get('tty') or {}).get('index', '?')}"}
    return {"type": kind.lower(), "name": "-"}


def describe(criu_dir: Path, stats_dir: Optional[Path] = None) -> dict[str, Any]:
    """``{"processes", "files", "sockets", "mounts", "stats"}`` of one CRIU images directory;
    ``stats_dir``: where CRIU's ``stats-dump`` is (npusnap keeps it in the image's ``logs/``)."""
    files_by_id = {int(e["id"]): e for e in _entries(criu_dir / "files.img") if "id" in e}
    # A connected unix socket names its peer by inode: show the peer's path when it has one.
    unix_names = {
        int((e.get("usk") or {}).get("ino", 0)): _unix_name((e.get("usk") or {}).get("name"))
        for e in files_by_id.values()
        if e.get("type") == "UNIXSK"
    }
    tree = _entries(criu_dir / "pstree.img")
    processes: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    sockets: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    mount_ns: set[int] = set()
    for task in tree:
        pid = int(task.get("pid", 0))
        ids = (_entries(criu_dir / f"ids-{pid}.img") or [{}])[0]
        files_id = ids.get("files_id")
        if ids.get("mnt_ns_id") is not None:
            mount_ns.add(int(ids["mnt_ns_id"]))
        fds = _entries(criu_dir / f"fdinfo-{files_id}.img") if files_id is not None else []
        processes.append(
            {
                "pid": pid,
                "ppid": int(task.get("ppid", 0)),
                "threads": list(task.get("threads") or []),
                "fds": len(fds),
            }
        )
        for fd in fds:
            entry = files_by_id.get(int(fd.get("id", -1)))
            described = (
                _describe_file(entry) if entry else {"type": str(fd.get("type", "?")).lower(), "name": "-"}
            )
            row = {"pid": pid, "fd": int(fd.get("fd", -1)), **described}
            peer = described.get("peer_inode")
            if peer and unix_names.get(int(peer), "(unnamed)") != "(unnamed)":
                row["peer"] = unix_names[int(peer)]
            (sockets if described["type"] == "socket" else files).append(row)
    for ns in sorted(mount_ns):
        for m in _entries(criu_dir / f"mountpoints-{ns}.img"):
            mounts.append(
                {
                    "mount_ns": ns,
                    "mountpoint": m.get("mountpoint", "?"),
                    "fstype": m.get("fstype", "?"),
                    "source": m.get("source", ""),
                    "root": m.get("root", ""),
                    "external": bool(m.get("ext_key") or m.get("ext_mount")),
                }
            )
    return {
        "processes": processes,
        "files": files,
        "sockets": sockets,
        "mounts": mounts,
        "stats": dump_stats(stats_dir) if stats_dir is not None else None,
    }


def dump_stats(directory: Path) -> Optional[dict[str, Any]]:
    """CRIU's dump statistics (``stats-dump``), with bytes beside the page counts."""
    raw = None
    with contextlib.suppress(Exception):
        raw = criu.load_stats(str(directory), criu.STATS_DUMP_FILE)
    if not raw:
        return None
    out: dict[str, Any] = dict(raw)
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


def describe_archive(path: Path, *, container: bool, prefix: str = "") -> dict[str, Any]:
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
