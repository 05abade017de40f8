"""CRIU's image files, read in one place: pycriu decodes them, and the entries npusnap decides
anything on come out as typed records (the process tree, file remaps, regular files, unix and TCP
sockets, CRIU's statistics). Every other module reads CRIU images through this one; what only
shows an image (criudetail.py) takes the decoded entries as they are.

pycriu is imported where it is used: its protobuf modules take tens of milliseconds that `--help`
and most commands never need.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

# Images older than remap_type mark a ghost by this bit of remap_id (criu/include/image.h).
REMAP_GHOST = 1 << 31
TCP_ESTABLISHED = 1
TCP_LISTEN = 10
SOCK_STREAM, SOCK_SEQPACKET = 1, 5


class Undecodable(Exception):
    """A CRIU image file that pycriu cannot decode: damaged, or not CRIU's."""


def load(path: PathLike) -> dict[str, Any]:
    """The decoded image file: ``OSError`` as ``open`` raises it (FileNotFoundError when there is
    none), ``Undecodable`` when pycriu cannot decode it."""
    import pycriu

    with open(path, "rb") as f:
        try:
            data: dict[str, Any] = pycriu.images.load(f)
        except Exception as exc:
            raise Undecodable(f"{path}: {exc}") from None
    return data


def entries(path: PathLike) -> list[dict[str, Any]]:
    """The entries of an image file (``load``'s errors)."""
    return list(load(path).get("entries") or [])


def write(data: dict[str, Any], path: PathLike) -> None:
    """Encode ``data`` (as ``load`` gave it, changed) into a new image file at ``path``."""
    import pycriu

    with open(path, "wb") as f:
        pycriu.images.dump(data, f)


def _entries_or_none(path: Path) -> Optional[list[dict[str, Any]]]:
    try:
        return entries(path)
    except FileNotFoundError:
        return None


# -- the process tree -------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeEntry:
    """A process of ``pstree.img``: ids of the tree's own pid namespace for a `run --pid-ns` job."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    threads: tuple[int, ...]


def pstree(criu_dir: Path) -> Optional[list[TreeEntry]]:
    """The processes CRIU dumped and will restore, zombies included; None when the directory has
    no ``pstree.img``. ``Undecodable`` also for an entry without its ids."""
    raw = _entries_or_none(criu_dir / "pstree.img")
    if raw is None:
        return None
    try:
        return [
            TreeEntry(
                pid=int(e["pid"]),
                ppid=int(e.get("ppid") or 0),
                pgid=int(e.get("pgid") or 0),
                sid=int(e.get("sid") or 0),
                threads=tuple(int(t) for t in e.get("threads") or ()),
            )
            for e in raw
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise Undecodable(f"{criu_dir / 'pstree.img'}: an entry without its ids ({exc})") from None


# A task's state in core-PID.img (compel's enum __compel_task_state, compel/include/uapi/task-state.h).
TASK_STOPPED = 0x03


def stopped(criu_dir: Path) -> dict[int, int]:
    """The processes of the image that CRIU restores stopped, as they were (job-control stopped
    by a signal), by pstree.img id: the signal that stopped each (0 when the image does not say;
    CRIU then stops it with SIGSTOP). A restore that lets the tree run must not resume them."""
    out = {}
    for e in pstree(criu_dir) or ():
        raw = _entries_or_none(criu_dir / f"core-{e.pid}.img")
        tc = (raw or [{}])[0].get("tc") or {}
        if tc.get("task_state") == TASK_STOPPED:
            out[e.pid] = int(tc.get("stop_signo") or 0)
    return out


# -- files --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remap:
    """An entry of ``remap-fpath.img``: the file ``orig_id`` of ``files.img`` is restored through
    a ghost copy in the image (``GHOST``: ``remap_id`` is the ghost's id) or a link CRIU made on
    the host (``LINKED``: ``remap_id`` is the link's own ``files.img`` id), or another way."""

    orig_id: int
    remap_id: int
    kind: str


def remaps(criu_dir: Path) -> list[Remap]:
    """The remaps of an image ([] when it has none). Images older than ``remap_type`` say a ghost
    with a bit of ``remap_id`` and anything else is a link."""
    out = []
    for e in _entries_or_none(criu_dir / "remap-fpath.img") or []:
        rid = int(e["remap_id"])
        kind = e.get("remap_type") or ("GHOST" if rid & REMAP_GHOST else "LINKED")
        out.append(Remap(orig_id=int(e["orig_id"]), remap_id=rid & ~REMAP_GHOST, kind=str(kind)))
    return out


def regular_files(criu_dir: Path) -> dict[int, str]:
    """The regular files of ``files.img``: id -> name, as CRIU recorded it."""
    return {
        int(e["id"]): str(e["reg"]["name"]) for e in entries(criu_dir / "files.img") if e.get("type") == "REG"
    }


def _unix_name(name: str) -> str:
    return name[:-3] if name.endswith("=00") else name  # pycriu's form of a trailing NUL


@dataclass(frozen=True)
class UnixSocket:
    """A unix socket of ``files.img``; ``name`` without pycriu's ``=00`` for a trailing NUL."""

    id: int
    name: Optional[str]
    state: int
    type: int

    @property
    def listening_stream(self) -> bool:
        return self.state == TCP_LISTEN and self.type in (SOCK_STREAM, SOCK_SEQPACKET)


def unix_sockets(criu_dir: Path) -> list[UnixSocket]:
    out = []
    for e in entries(criu_dir / "files.img"):
        usk = e.get("usk") if e.get("type") == "UNIXSK" else None
        if not usk:
            continue
        name = usk.get("name")
        out.append(
            UnixSocket(
                id=int(e.get("id") or 0),
                name=_unix_name(name) if isinstance(name, str) else None,
                state=int(usk.get("state") or 0),
                type=int(usk.get("type") or 0),
            )
        )
    return out


@dataclass(frozen=True)
class TcpConnection:
    """An established TCP socket of ``files.img``: its two ends as text addresses."""

    src: str
    src_port: int
    dst: str
    dst_port: int


def tcp_connections(criu_dir: Path) -> list[TcpConnection]:
    out = []
    for e in entries(criu_dir / "files.img"):
        isk = e.get("isk") if e.get("type") == "INETSK" else None
        if not isk or isk.get("proto") != socket.IPPROTO_TCP or isk.get("state") != TCP_ESTABLISHED:
            continue
        fam = socket.AF_INET6 if isk.get("family") == socket.AF_INET6 else socket.AF_INET

        def ip(words: list[int], fam: int = fam) -> str:
            return socket.inet_ntop(fam, b"".join(int(w).to_bytes(4, "little") for w in words))

        out.append(
            TcpConnection(
                ip(isk["src_addr"]), int(isk["src_port"]), ip(isk["dst_addr"]), int(isk["dst_port"])
            )
        )
    return out


# -- CRIU's statistics --------------------------------------------------------------------------


def stats(path: PathLike) -> Optional[dict[str, int]]:
    """A CRIU stats image's counters (of its dump or restore section); None when there is none or
    it does not decode. pycriu's generic decoder breaks on protobuf 5+ (FieldDescriptor.label is
    gone), so the one message is decoded here: the service magic, the STATS magic, then one
    length-prefixed stats_entry."""
    if not os.path.exists(path):
        return None
    try:
        from pycriu.images import stats_pb2

        with open(path, "rb") as f:
            data = f.read()
        (size,) = struct.unpack_from("<I", data, 8)
        entry = stats_pb2.stats_entry()
        entry.ParseFromString(data[12 : 12 + size])
        section = entry.dump if entry.HasField("dump") else entry.restore
        return {fd.name: int(value) for fd, value in section.ListFields()}
    except Exception:
        return None
