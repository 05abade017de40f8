"""CRIU's image files, read in one place into typed records: the process tree (``pstree.img``),
each task's state (``core-PID.img``) and ids (``ids-PID.img``), its file descriptors
(``fdinfo-ID.img``), the files behind them (``files.img``: regular files, unix and inet sockets,
pipes), remaps of deleted files (``remap-fpath.img``), mounts (``mountpoints-ID.img``) and CRIU's
statistics. Every other module reads CRIU images through this one, by attribute.

Each entry is decoded with the protobuf message CRIU's .proto defines for its image (pycriu's
descriptors), so a field the image leaves out has the default protobuf gives it (the .proto's
``[default = ...]``, else zero, empty, false); where CRIU itself tells "absent" from that default
(``has_size``, an older image without ``remap_type``), the record says so. An entry without a
field the .proto requires is refused, as CRIU's own reader refuses it.

pycriu is imported where it is used: its protobuf modules take tens of milliseconds that `--help`
and most commands never need.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
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
    """A CRIU image file that cannot be decoded: damaged, not CRIU's, or not of the kind read."""


# -- the file format ----------------------------------------------------------------------------
#
# An image file: a first magic (IMG_COMMON, or IMG_SERVICE for stats; none for inventory), the
# image's own magic, then its entries, each a 32-bit length and that many bytes of one protobuf
# message (criu/protobuf.c). The kinds read here carry no payload between entries.


@dataclass(frozen=True)
class _Image:
    head: bytes  # the magics, as they were
    entries: list[tuple[bytes, Any]]  # each entry's encoded bytes and its decoded message


def _decode(data: bytes, kind: str, path: PathLike) -> _Image:
    from pycriu.images import images, magic

    try:
        (first,) = struct.unpack_from("=I", data, 0)
        off = 4
        if first in (magic.by_name["IMG_COMMON"], magic.by_name["IMG_SERVICE"]):
            (first,) = struct.unpack_from("=I", data, off)
            off = 8
    except struct.error:
        raise Undecodable(f"{path}: too short for a CRIU image") from None
    if first != magic.by_name[kind]:
        raise Undecodable(f"{path}: not a {kind} image (magic {first:#x})")
    message = images.handlers[kind].payload
    head, entries = data[:off], []
    while off < len(data):
        if off + 4 > len(data):
            raise Undecodable(f"{path}: truncated at byte {off}")
        (size,) = struct.unpack_from("=I", data, off)
        raw = data[off + 4 : off + 4 + size]
        if len(raw) != size:
            raise Undecodable(f"{path}: truncated at byte {off}")
        msg = message()
        try:
            msg.ParseFromString(raw)
        except Exception as exc:
            raise Undecodable(f"{path}: an entry at byte {off} does not decode ({exc})") from None
        if not msg.IsInitialized():
            missing = ", ".join(msg.FindInitializationErrors())
            raise Undecodable(f"{path}: an entry at byte {off} without {missing}")
        entries.append((raw, msg))
        off += 4 + size
    return _Image(head, entries)


def _read(path: PathLike, kind: str) -> _Image:
    """The image file of ``kind`` (pycriu's magic name) at ``path``: ``OSError`` as ``open`` raises
    it (FileNotFoundError when there is none), ``Undecodable`` when it does not decode as one."""
    with open(path, "rb") as f:
        data = f.read()
    return _decode(data, kind, path)


def _messages(path: PathLike, kind: str) -> list[Any]:
    return [msg for _raw, msg in _read(path, kind).entries]


def _messages_or_none(path: Path, kind: str) -> Optional[list[Any]]:
    try:
        return _messages(path, kind)
    except FileNotFoundError:
        return None


def _enum_name(msg: Any, field: str) -> str:
    value = getattr(msg, field)
    names = msg.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number
    return str(names[value].name) if value in names else str(value)


def _optional(msg: Any, field: str) -> Optional[int]:
    return int(getattr(msg, field)) if msg.HasField(field) else None


# -- the process tree and its tasks -------------------------------------------------------------


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
    no ``pstree.img``."""
    raw = _messages_or_none(criu_dir / "pstree.img", "PSTREE")
    if raw is None:
        return None
    return [TreeEntry(e.pid, e.ppid, e.pgid, e.sid, tuple(int(t) for t in e.threads)) for e in raw]


# A task's state in core-PID.img (compel's enum __compel_task_state, compel/include/uapi/task-state.h).
TASK_ALIVE = 0x01
TASK_DEAD = 0x02  # a zombie
TASK_STOPPED = 0x03


@dataclass(frozen=True)
class TaskCore:
    """The task state of ``core-PID.img`` (its ``tc``; registers and the rest are not read)."""

    state: int  # TASK_ALIVE, TASK_DEAD, TASK_STOPPED
    exit_code: int
    stop_signo: int  # the signal that stopped a TASK_STOPPED task; 0 in images older than it


def core(criu_dir: Path, pid: int) -> Optional[TaskCore]:
    """The task ``pid`` (a ``pstree.img`` id) as CRIU saved it; None when it has no core image."""
    raw = _messages_or_none(criu_dir / f"core-{pid}.img", "CORE")
    if not raw:
        return None
    tc = raw[0].tc
    return TaskCore(state=tc.task_state, exit_code=tc.exit_code, stop_signo=tc.stop_signo)


def stopped(criu_dir: Path) -> dict[int, int]:
    """The processes of the image that CRIU restores stopped, as they were (job-control stopped
    by a signal), by pstree.img id: the signal that stopped each (0 when the image does not say;
    CRIU then stops it with SIGSTOP). A restore that lets the tree run must not resume them."""
    out = {}
    for e in pstree(criu_dir) or ():
        tc = core(criu_dir, e.pid)
        if tc is not None and tc.state == TASK_STOPPED:
            out[e.pid] = tc.stop_signo
    return out


@dataclass(frozen=True)
class TaskIds:
    """The objects of ``ids-PID.img`` a task shares with others: its file table (``fdinfo-ID.img``)
    and its mount namespace (``mountpoints-ID.img``; 0 when the image names none)."""

    files_id: int
    mnt_ns_id: int


def ids(criu_dir: Path, pid: int) -> Optional[TaskIds]:
    """The ids of the task ``pid``; None when it has no ids image."""
    raw = _messages_or_none(criu_dir / f"ids-{pid}.img", "IDS")
    if not raw:
        return None
    return TaskIds(files_id=raw[0].files_id, mnt_ns_id=raw[0].mnt_ns_id)


# -- files --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fdinfo:
    """A file descriptor of ``fdinfo-ID.img``: its number and the ``files.img`` id behind it."""

    fd: int
    id: int
    type: str  # CRIU's fd_types name: REG, PIPE, UNIXSK, INETSK, TTY, ...
    flags: int


def fdinfo(criu_dir: Path, files_id: int) -> list[Fdinfo]:
    """The file descriptors of the file table ``files_id`` (``_read``'s errors)."""
    return [
        Fdinfo(fd=e.fd, id=e.id, type=_enum_name(e, "type"), flags=e.flags)
        for e in _messages(criu_dir / f"fdinfo-{files_id}.img", "FDINFO")
    ]


@dataclass(frozen=True)
class RegFile:
    """A regular file of ``files.img``, by the name CRIU recorded."""

    name: str
    pos: int
    size: Optional[int]  # None: not recorded (has_size: CRIU leaves it out for O_WRONLY|O_APPEND)
    flags: int


@dataclass(frozen=True)
class UnixSocket:
    """A unix socket of ``files.img``. ``name`` is its bytes as bound (a trailing NUL when bound
    with its terminator, a leading NUL for an abstract name; empty when unbound)."""

    id: int
    ino: int
    type: int  # SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    state: int  # TCP_LISTEN, TCP_ESTABLISHED, TCP_CLOSE: the kernel's states for unix sockets too
    peer: int  # the peer's ino, 0 when it has none
    name: bytes

    @property
    def path(self) -> str:
        """The bound name as text, without a trailing NUL."""
        return os.fsdecode(self.name[:-1] if self.name.endswith(b"\0") else self.name)

    @property
    def listening_stream(self) -> bool:
        return self.state == TCP_LISTEN and self.type in (SOCK_STREAM, SOCK_SEQPACKET)


@dataclass(frozen=True)
class InetSocket:
    """An inet socket of ``files.img``: addresses as CRIU keeps them, 32-bit words of network-order
    bytes (one for IPv4, four for IPv6)."""

    id: int
    family: int
    type: int
    proto: int
    state: int
    src_addr: tuple[int, ...]
    src_port: int
    dst_addr: tuple[int, ...]
    dst_port: int


@dataclass(frozen=True)
class FileEntry:
    """An open file of ``files.img``: its id (``Fdinfo.id``), its kind, and what npusnap reads of
    the kinds it looks into (None for the others, or when the entry lacks it)."""

    id: int
    type: str  # CRIU's fd_types name
    reg: Optional[RegFile] = None
    usk: Optional[UnixSocket] = None
    isk: Optional[InetSocket] = None
    pipe_id: Optional[int] = None


def _file(e: Any) -> FileEntry:
    kind = _enum_name(e, "type")
    reg = usk = isk = None
    if e.HasField("reg"):
        r = e.reg
        reg = RegFile(name=r.name, pos=r.pos, size=_optional(r, "size"), flags=r.flags)
    if e.HasField("usk"):
        u = e.usk
        usk = UnixSocket(id=u.id, ino=u.ino, type=u.type, state=u.state, peer=u.peer, name=bytes(u.name))
    if e.HasField("isk"):
        i = e.isk
        isk = InetSocket(
            id=i.id,
            family=i.family,
            type=i.type,
            proto=i.proto,
            state=i.state,
            src_addr=tuple(int(w) for w in i.src_addr),
            src_port=i.src_port,
            dst_addr=tuple(int(w) for w in i.dst_addr),
            dst_port=i.dst_port,
        )
    pipe_id = e.pipe.pipe_id if e.HasField("pipe") else None
    return FileEntry(id=e.id, type=kind, reg=reg, usk=usk, isk=isk, pipe_id=pipe_id)


def files(criu_dir: Path) -> list[FileEntry]:
    """The open files of ``files.img`` (``_read``'s errors)."""
    return [_file(e) for e in _messages(criu_dir / "files.img", "FILES")]


def regular_files(criu_dir: Path) -> dict[int, str]:
    """The regular files of ``files.img``: id -> name, as CRIU recorded it."""
    return {f.id: f.reg.name for f in files(criu_dir) if f.type == "REG" and f.reg is not None}


def unix_sockets(criu_dir: Path) -> list[UnixSocket]:
    return [f.usk for f in files(criu_dir) if f.type == "UNIXSK" and f.usk is not None]


@dataclass(frozen=True)
class TcpConnection:
    """An established TCP socket of ``files.img``: its two ends as text addresses."""

    src: str
    src_port: int
    dst: str
    dst_port: int


def inet_address(family: int, words: tuple[int, ...]) -> str:
    """CRIU's words of an address as text (``ValueError`` for words of another length)."""
    fam = socket.AF_INET6 if family == socket.AF_INET6 else socket.AF_INET
    return socket.inet_ntop(fam, b"".join(w.to_bytes(4, "little") for w in words))


def tcp_connections(criu_dir: Path) -> list[TcpConnection]:
    out = []
    for f in files(criu_dir):
        isk = f.isk if f.type == "INETSK" else None
        if isk is None or isk.proto != socket.IPPROTO_TCP or isk.state != TCP_ESTABLISHED:
            continue
        src, dst = inet_address(isk.family, isk.src_addr), inet_address(isk.family, isk.dst_addr)
        out.append(TcpConnection(src, isk.src_port, dst, isk.dst_port))
    return out


def rename_unix_sockets(criu_dir: Path, dest: Path, rename: Callable[[bytes], Optional[bytes]]) -> None:
    """Write ``criu_dir``'s ``files.img`` to the new file ``dest`` with each unix socket bound
    under ``rename(name)`` (None: its name unchanged); every other entry as it was, byte for byte."""
    image = _read(criu_dir / "files.img", "FILES")
    out = [image.head]
    for raw, e in image.entries:
        new = rename(bytes(e.usk.name)) if e.HasField("usk") and _enum_name(e, "type") == "UNIXSK" else None
        if new is not None:
            e.usk.name = new
            raw = e.SerializeToString()
        out += [struct.pack("=I", len(raw)), raw]
    with open(dest, "wb") as f:
        f.write(b"".join(out))


@dataclass(frozen=True)
class Remap:
    """An entry of ``remap-fpath.img``: the file ``orig_id`` of ``files.img`` is restored through
    a ghost copy in the image (``GHOST``: ``remap_id`` is the ghost's id) or a link CRIU made on
    the host (``LINKED``: ``remap_id`` is the link's own ``files.img`` id), or another way."""

    orig_id: int
    remap_id: int
    kind: str


def remaps(criu_dir: Path) -> list[Remap]:
    """The remaps of an image ([] when it has none). An image older than ``remap_type`` says a
    ghost with a bit of ``remap_id`` and anything else is a link, as CRIU reads it
    (criu/files-reg.c, ``collect_one_remap``)."""
    out = []
    for e in _messages_or_none(criu_dir / "remap-fpath.img", "REMAP_FPATH") or []:
        rid = e.remap_id
        if e.HasField("remap_type"):
            kind = _enum_name(e, "remap_type")
        else:
            kind = "GHOST" if rid & REMAP_GHOST else "LINKED"
        out.append(Remap(orig_id=e.orig_id, remap_id=rid & ~REMAP_GHOST, kind=kind))
    return out


# -- mounts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """A mount of ``mountpoints-ID.img`` (``fstype``: CRIU's number of the filesystem type)."""

    mnt_id: int
    mountpoint: str
    fstype: int
    source: str
    root: str
    ext_key: str  # the key of an external mount (--external mnt[KEY]); "" for others
    ext_mount: bool  # an external mount of an image older than ext_key


def mounts(criu_dir: Path, mnt_ns_id: int) -> list[Mount]:
    """The mounts of the mount namespace ``mnt_ns_id`` (``_read``'s errors)."""
    return [
        Mount(
            mnt_id=m.mnt_id,
            mountpoint=m.mountpoint,
            fstype=m.fstype,
            source=m.source,
            root=m.root,
            ext_key=m.ext_key,
            ext_mount=m.ext_mount,
        )
        for m in _messages(criu_dir / f"mountpoints-{mnt_ns_id}.img", "MNTS")
    ]


# -- CRIU's statistics --------------------------------------------------------------------------


def stats(path: PathLike) -> Optional[dict[str, int]]:
    """A CRIU stats image's counters, those its dump or restore section records, by the .proto's
    names; None when there is none or it does not decode."""
    if not os.path.exists(path):
        return None
    try:
        (entry,) = _messages(path, "STATS")
        section = entry.dump if entry.HasField("dump") else entry.restore
        return {fd.name: int(value) for fd, value in section.ListFields()}
    except Exception:
        return None
