"""The image directory: its layout, the manifest (``npusnap.json``), checksums and atomic publishing.

Every name inside an image is a constant here, and nowhere else::

    DIR/                  mode 0700: it holds the processes' memory, i.e. their secrets
      npusnap.json        the manifest (schema below)
      criu/               CRIU's image files (pages, core, fdinfo, ...)
      hostfiles/          copies of tmpfs files the tree had open or mapped (/dev/shm ...), by path
      device/             devmem-PID.bin: the device memory npusnap kept for NPU process PID
      logs/               CRIU's dump/restore logs and stats (not checksummed: restore writes here)

An image is built in a temporary sibling (``.DIR.npusnap-tmp-*``), fsynced (files, then
directories) and renamed into place only when complete, so a crash never leaves a directory that
looks like a finished image. ``verify`` checks schema, structure and every file's checksum
(digest.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.image import digest

if TYPE_CHECKING:
    # Imported where used (Manifest.from_dict): host/hostres.py imports image/digest.py, and
    # importing that runs this package's __init__ first, so a top-level import here would be
    # circular whenever hostres is imported before the image package.
    from npusnap_cli.host.hostres import ExternalStdio, HostFile, HostNode

SCHEMA_VERSION = 1
MANIFEST_NAME = "npusnap.json"
CRIU_SUBDIR = "criu"
LOGS_SUBDIR = "logs"
HOSTFILES_SUBDIR = "hostfiles"
DEVICE_SUBDIR = "device"
# The subdirectories whose files the manifest lists with their checksums (never logs/).
CHECKSUMMED_SUBDIRS = (CRIU_SUBDIR, HOSTFILES_SUBDIR, DEVICE_SUBDIR)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
DIR_MODE = 0o700
FILE_MODE = 0o600
TMP_MARKER = ".npusnap-tmp-"
OLD_MARKER = ".npusnap-old-"
_HASH_CHUNK = 1 << 20

ProgressFn = Callable[[int], None]


# --------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------


def _req(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ImageError(
            f"manifest field {where}.{key} is missing",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    value = data[key]
    # bool is an int: refuse it where a number is meant
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ImageError(
            f"manifest field {where}.{key} has the wrong type ({type(value).__name__})",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _opt(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if data.get(key) is None:
        return None
    return _req(data, key, kind, where)


def _only(data: Mapping[str, Any], keys: Any, where: str) -> None:
    """Refuse fields the schema does not have (a manifest is checked, not merely read)."""
    extra = sorted(str(k) for k in data if k not in keys)
    if extra:
        raise ImageError(
            f"manifest field {where}.{extra[0]} is not part of schema {SCHEMA_VERSION}",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )


def _list_of(data: Mapping[str, Any], key: str, kind: type, where: str) -> list[Any]:
    items: list[Any] = _req(data, key, list, where)
    for item in items:
        if not isinstance(item, kind) or (isinstance(item, bool) and kind is not bool):
            raise ImageError(
                f"manifest field {where}.{key} holds a {type(item).__name__}, not a {kind.__name__}",
                why="the manifest was written by another tool or edited by hand",
                fix="use an image written by this npusnap version, or dump again",
            )
    return items


_DEFAULT_ALGO = digest.DEFAULT  # (a field named digest hides the module in class bodies)


@dataclass(frozen=True)
class Versions:
    tool: str
    criu: str
    cann: Optional[str]
    cann_simulated: bool
    python: str
    # Where the CANN that backed the device state up lives, so that a restore from a shell
    # without the CANN environment can find it.
    cann_home: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "criu": self.criu,
            "cann": self.cann,
            "cann_simulated": self.cann_simulated,
            "python": self.python,
            "cann_home": self.cann_home,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Versions:
        w = "versions"
        _only(d, cls.__dataclass_fields__, w)
        return cls(
            tool=_req(d, "tool", str, w),
            criu=_req(d, "criu", str, w),
            cann=_opt(d, "cann", str, w),
            cann_simulated=_req(d, "cann_simulated", bool, w),
            python=_req(d, "python", str, w),
            cann_home=_opt(d, "cann_home", str, w),
        )


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    kernel: str
    machine: str

    def to_dict(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "kernel": self.kernel, "machine": self.machine}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostInfo:
        w = "host"
        _only(d, cls.__dataclass_fields__, w)
        return cls(
            hostname=_req(d, "hostname", str, w),
            kernel=_req(d, "kernel", str, w),
            machine=_req(d, "machine", str, w),
        )

    @classmethod
    def current(cls) -> HostInfo:
        u = os.uname()
        return cls(hostname=u.nodename, kernel=u.release, machine=u.machine)


@dataclass(frozen=True)
class ProcessEntry:
    """One process of the dumped tree."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    uid: int
    agent: bool  # it had an agent (a control socket)
    npu: bool = False  # its device state was backed up: restore must Restore and Unlock it
    devices: tuple[int, ...] = ()
    device_bytes: int = 0
    agent_socket: Optional[str] = None
    # The token of the lock this dump holds on the process (docs/internals.md, "Lock ownership"):
    # restore presents it to the restored agent, which still records the dump as its owner.
    lock_token: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "cmdline": list(self.cmdline),
            "uid": self.uid,
            "agent": self.agent,
            "npu": self.npu,
            "devices": list(self.devices),
            "device_bytes": self.device_bytes,
            "agent_socket": self.agent_socket,
            "lock_token": self.lock_token,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProcessEntry:
        if not isinstance(d, Mapping):
            raise ImageError("manifest field processes holds a non-object", fix="dump again")
        w = f"processes[{d.get('pid', '?')}]"
        _only(d, cls.__dataclass_fields__, w)
        return cls(
            pid=_req(d, "pid", int, w),
            ppid=_req(d, "ppid", int, w),
            cmdline=tuple(_list_of(d, "cmdline", str, w)),
            uid=_req(d, "uid", int, w),
            agent=_req(d, "agent", bool, w),
            npu=_req(d, "npu", bool, w),
            devices=tuple(_list_of(d, "devices", int, w)),
            device_bytes=_req(d, "device_bytes", int, w),
            agent_socket=_opt(d, "agent_socket", str, w),
            lock_token=_opt(d, "lock_token", str, w),
        )


@dataclass(frozen=True)
class Timings:
    """Per-phase durations of a dump, in seconds (None: the phase did not run)."""

    preflight_s: Optional[float] = None
    lock_s: Optional[float] = None
    backup_s: Optional[float] = None
    criu_freeze_s: Optional[float] = None
    criu_memdump_s: Optional[float] = None
    criu_memwrite_s: Optional[float] = None
    criu_total_s: Optional[float] = None
    publish_s: Optional[float] = None
    unlock_s: Optional[float] = None
    frozen_s: Optional[float] = None
    total_s: Optional[float] = None
    # The longest the dump's own attach stopped a process of the job (upper bound; None: the
    # dump attached nothing): the job stalls then too, before and apart from frozen_s.
    attach_stopped_s: Optional[float] = None

    def to_dict(self) -> dict[str, Optional[float]]:
        return {k: (None if v is None else round(v, 6)) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timings:
        _only(d, cls.__dataclass_fields__, "timings")
        known = {k: _opt(d, k, (int, float), "timings") for k in cls.__dataclass_fields__}
        return cls(**{k: (None if v is None else float(v)) for k, v in known.items()})


@dataclass(frozen=True)
class ByteCounts:
    device_bytes: int = 0
    image_bytes: int = 0
    criu_pages_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ByteCounts:
        _only(d, cls.__dataclass_fields__, "bytes")
        return cls(**{k: _req(d, k, int, "bytes") for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the image directory, '/'-separated
    size: int
    digest: str  # hex, of the algorithm ``algo`` (digest.py)
    algo: str = _DEFAULT_ALGO

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, self.algo: self.digest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FileEntry:
        if not isinstance(d, Mapping):
            raise ImageError("manifest field files holds a non-object", fix="dump again")
        _only(d, ("path", "size", *digest.ALGORITHMS), "files")
        algo, value = digest.from_entry(d, "files")
        entry = cls(
            path=_req(d, "path", str, "files"),
            size=_req(d, "size", int, "files"),
            digest=value,
            algo=algo,
        )
        if entry.path.startswith("/") or ".." in entry.path.split("/"):
            raise ImageError(
                f"manifest lists a file outside the image: {entry.path}",
                why="the manifest was tampered with",
                fix="do not use this image; dump again",
            )
        return entry


@dataclass(frozen=True)
class Manifest:
    """The content of ``npusnap.json``."""

    created_at: str
    versions: Versions
    host: HostInfo
    root_pid: int
    processes: tuple[ProcessEntry, ...]
    timings: Timings
    bytes: ByteCounts
    criu_options: Mapping[str, Any] = field(default_factory=dict)
    files: tuple[FileEntry, ...] = ()
    leave_running: bool = False
    # {"mode": preserve|app|discard, "continuity": npusnap|application|lost, "processes": {...}}
    # (docs/device-memory.md); empty in images made before npusnap kept device memory.
    device_memory: Mapping[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    # tmpfs files the tree had open or mapped, saved under hostfiles/ (see hostres.py).
    host_files: tuple[HostFile, ...] = ()
    # Pipes to processes outside the tree, recorded with --external-pipes (restore --pipe-to).
    external_stdio: tuple[ExternalStdio, ...] = ()
    # Directories and FIFOs the restored tree needs on the host (hostres.find_host_nodes).
    host_nodes: tuple[HostNode, ...] = ()
    # Host pid (a string) -> pid in the job's own pid namespace, for a tree whose root is init
    # of one (`run --pid-ns`, host/pidns.py); empty otherwise.
    pid_ns: Mapping[str, int] = field(default_factory=dict)

    @property
    def npu_processes(self) -> tuple[ProcessEntry, ...]:
        return tuple(p for p in self.processes if p.npu)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "created_at": self.created_at,
            "versions": self.versions.to_dict(),
            "host": self.host.to_dict(),
            "root_pid": self.root_pid,
            "leave_running": self.leave_running,
            "processes": [p.to_dict() for p in self.processes],
            "timings": self.timings.to_dict(),
            "bytes": self.bytes.to_dict(),
            "criu_options": dict(self.criu_options),
            "device_memory": dict(self.device_memory),
            "files": [f.to_dict() for f in self.files],
            "host_files": [f.to_dict() for f in self.host_files],
            "external_stdio": [e.to_dict() for e in self.external_stdio],
            "host_nodes": [n.to_dict() for n in self.host_nodes],
            "pid_ns": dict(self.pid_ns),
        }

    def to_json(self) -> str:
        d = self.to_dict()
        d[SELF_HASH_KEY] = _self_hash(d)
        return json.dumps(d, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        if not isinstance(d, Mapping):
            raise ImageError("the manifest is not a JSON object", fix="dump again")
        _only(d, set(cls.__dataclass_fields__), "manifest")
        schema = _req(d, "schema", int, "manifest")
        if schema != SCHEMA_VERSION:
            from npusnap_cli.errors import IncompatibleImageError

            raise IncompatibleImageError(
                f"unsupported image schema {schema} (this npusnap reads schema {SCHEMA_VERSION})",
                why="the image was written by a different npusnap version",
                fix="restore it with the npusnap version that wrote it (see versions.tool in npusnap.json)",
            )
        from npusnap_cli.host import pidns
        from npusnap_cli.host.hostres import ExternalStdio, HostFile, HostNode

        return cls(
            schema=schema,
            created_at=_req(d, "created_at", str, "manifest"),
            versions=Versions.from_dict(_req(d, "versions", dict, "manifest")),
            host=HostInfo.from_dict(_req(d, "host", dict, "manifest")),
            root_pid=_req(d, "root_pid", int, "manifest"),
            leave_running=_req(d, "leave_running", bool, "manifest"),
            processes=tuple(ProcessEntry.from_dict(p) for p in _req(d, "processes", list, "manifest")),
            timings=Timings.from_dict(_req(d, "timings", dict, "manifest")),
            bytes=ByteCounts.from_dict(_req(d, "bytes", dict, "manifest")),
            criu_options=_criu_options(_req(d, "criu_options", dict, "manifest")),
            files=tuple(FileEntry.from_dict(f) for f in _req(d, "files", list, "manifest")),
            host_files=tuple(HostFile.from_dict(f) for f in _opt(d, "host_files", list, "manifest") or ()),
            external_stdio=tuple(
                ExternalStdio.from_dict(e) for e in _opt(d, "external_stdio", list, "manifest") or ()
            ),
            device_memory=dict(d.get("device_memory") or {}),
            host_nodes=tuple(HostNode.from_dict(n) for n in _opt(d, "host_nodes", list, "manifest") or ()),
            pid_ns=pidns.check_map(d.get("pid_ns")),
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        from npusnap_cli.image import imagetrust

        imagetrust.check_json_depth(text)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ImageError(
                f"{MANIFEST_NAME} is not valid JSON: {exc}",
                why="the image is truncated or was edited",
                fix="do not use this image; dump again",
            ) from None
        if not isinstance(data, dict):
            raise ImageError("the manifest is not a JSON object", fix="dump again")
        recorded = data.pop(SELF_HASH_KEY, None)
        if recorded != _self_hash(data):
            raise ImageError(
                f"{MANIFEST_NAME} was edited after the dump: its {SELF_HASH_KEY} does not match its content",
                why="a field of the manifest was changed by hand or by another tool",
                fix="do not use this image; dump again (or copy it again from its source)",
            )
        return cls.from_dict(data)


SELF_HASH_KEY = "manifest_sha256"

# The CRIU options a manifest may carry (criu.CriuOptions.to_dict) and their JSON types.
_CRIU_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "leave_running": (bool,),
    "leave_stopped": (bool,),
    "tcp_established": (bool,),
    "shell_job": (bool,),
    "file_locks": (bool,),
    "ext_unix_sk": (bool,),
    "external": (list,),
    "timeout": (int, type(None)),
    "log_level": (int,),
    "link_remap": (bool,),
    "network_lock": (str, type(None)),
}


def _criu_options(d: Mapping[str, Any]) -> dict[str, Any]:
    _only(d, _CRIU_OPTION_TYPES, "criu_options")
    for key, value in d.items():
        types = _CRIU_OPTION_TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ImageError(f"manifest field criu_options.{key} has the wrong type", fix="dump again")
    if any(not isinstance(x, str) for x in d.get("external") or []):
        raise ImageError("manifest field criu_options.external holds a non-string", fix="dump again")
    return dict(d)


def _self_hash(d: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON form (sorted keys, no spaces) without this field."""
    canon = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------


def manifest_path(image: Path) -> Path:
    return image / MANIFEST_NAME


def criu_dir(image: Path) -> Path:
    return image / CRIU_SUBDIR


def logs_dir(image: Path) -> Path:
    return image / LOGS_SUBDIR


def is_temp_name(name: str) -> bool:
    return TMP_MARKER in name or OLD_MARKER in name


def temp_siblings(final: Path) -> list[Path]:
    """Leftover work areas (``.NAME.npusnap-tmp-*``) and set-aside images (``.NAME.npusnap-old-*``)
    next to ``final``, from this or an interrupted earlier run. Only names are read: nothing here
    opens, stats through or follows an entry.
    """
    parent = final.parent
    prefixes = (f".{final.name}{TMP_MARKER}", f".{final.name}{OLD_MARKER}")
    try:
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))
    except OSError:
        return []


def create_temp_image(final: Path) -> Path:
    """Create the work area ``.<name>.npusnap-tmp-XXXX`` next to ``final`` (0700, with subdirs).

    Next to it, not in /tmp: the final rename must stay within one filesystem to be atomic.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    # Our pid is in the name so that a later dump can tell a dead run's leftovers from a live one.
    prefix = f".{final.name}{TMP_MARKER}{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=str(final.parent)))
    os.chmod(tmp, DIR_MODE)  # mkdtemp makes 0700 already; be explicit, it holds secrets
    criu_dir(tmp).mkdir(mode=DIR_MODE)
    logs_dir(tmp).mkdir(mode=DIR_MODE)
    return tmp


@dataclass(frozen=True)
class Leftover:
    """What the cleanup did with one leftover sibling of an image: ``action`` is ``removed``,
    ``recovered`` (a set-aside old image put back as DIR), ``kept`` (its dump still runs) or
    ``refused`` (not provably ours: a symlink, a FIFO, another user's); ``message`` says it."""

    path: Path
    action: str
    message: str


def _owner_pid(final: Path, name: str) -> Optional[int]:
    for marker in (TMP_MARKER, OLD_MARKER):
        prefix = f".{final.name}{marker}"
        if name.startswith(prefix):
            text = name[len(prefix) :].split("-", 1)[0]
            return int(text) if text.isdigit() else None
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "a special file"


def _open_dir_nofollow(name: str, dir_fd: Optional[int] = None) -> int:
    # O_NONBLOCK: should the name be swapped for a FIFO between our lstat and this open, open()
    # must not wait for a writer; O_DIRECTORY then fails it with ENOTDIR.
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    return os.open(name, flags, dir_fd=dir_fd)


def _open_parent(path: Path) -> int:
    """The directory the user named (it may be reached through a symlink, e.g. /var/run); what
    is looked at *inside* it is never followed."""
    return os.open(str(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)


def _rmtree_at(parent_fd: int, name: str, expect: os.stat_result) -> None:
    """Remove the directory ``name`` of ``parent_fd`` and everything in it, never following a
    symlink (every step is relative to a directory fd opened with O_NOFOLLOW), after checking
    that it is still the directory ``expect`` describes. Raises OSError.
    """
    fd = _open_dir_nofollow(name, parent_fd)
    try:
        if not os.path.samestat(os.fstat(fd), expect):
            raise OSError(errno.ESTALE, f"{name} was replaced while it was being removed")
        for _root, dirs, files, root_fd in os.fwalk(".", dir_fd=fd, topdown=False, follow_symlinks=False):
            for entry in dirs + files:
                st = os.stat(entry, dir_fd=root_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(entry, dir_fd=root_fd)
                else:
                    os.unlink(entry, dir_fd=root_fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _provably_ours(st: os.stat_result) -> Optional[str]:
    """Why an entry is not a directory this user created (None: it may be ours)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"it is {_kind(st.st_mode)}, not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by uid {os.geteuid()}"
    return None


def remove_stale_temps(final: Path) -> list[Leftover]:
    """Clean up what dumps of ``final`` that are gone (killed, crashed) left next to it.

    Only a real directory (lstat: no symlink, no FIFO) owned by this user whose dump process is
    gone is touched, through directory fds that never follow a symlink. A set-aside old image
    (``--force`` interrupted between its two renames) is put back as ``final`` when ``final`` is
    missing, and removed when ``final`` is there. Anything else is refused and reported.
    """
    out: list[Leftover] = []
    try:
        parent_fd = _open_parent(final.parent)
    except OSError:
        return out
    try:
        for path in temp_siblings(final):
            name = path.name
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                out.append(Leftover(path, "refused", f"left {path} alone: cannot lstat it ({exc.strerror})"))
                continue
            why = _provably_ours(st)
            if why is not None:
                out.append(
                    Leftover(
                        path,
                        "refused",
                        f"left {path} alone: it is named like an npusnap work directory but {why}; "
                        f"remove it yourself if it is not someone's (ls -ld {path})",
                    )
                )
                continue
            pid = _owner_pid(final, name)
            if pid is None or os.path.exists(f"/proc/{pid}"):
                out.append(
                    Leftover(path, "kept", f"kept {path}: the dump that made it (pid {pid}) still runs")
                )
                continue
            if OLD_MARKER in name and not os.path.lexists(final):
                has_manifest = os.path.lexists(path / MANIFEST_NAME)
                if has_manifest:
                    try:
                        os.rename(name, final.name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                        os.fsync(parent_fd)
                    except OSError as exc:
                        out.append(
                            Leftover(
                                path,
                                "refused",
                                f"could not put the set-aside image {path} back as {final}: {exc.strerror}",
                            )
                        )
                    else:
                        out.append(
                            Leftover(
                                path,
                                "recovered",
                                f"put {path} back as {final}: an earlier `dump --force` was killed "
                                "before its new image was in place",
                            )
                        )
                    continue
            try:
                _rmtree_at(parent_fd, name, st)
            except OSError as exc:
                out.append(Leftover(path, "refused", f"could not remove {path}: {exc.strerror or exc}"))
                continue
            if os.path.lexists(path):
                out.append(Leftover(path, "refused", f"could not remove {path}: it is still there"))
                continue
            what = "set-aside old image" if OLD_MARKER in name else "work directory"
            out.append(
                Leftover(
                    path, "removed", f"removed {path}, the {what} of an earlier dump that did not finish"
                )
            )
    finally:
        os.close(parent_fd)
    return out


def leftovers_hint(final: Path) -> str:
    """A sentence naming leftovers of interrupted dumps next to ``final`` (empty if none)."""
    found = temp_siblings(final)
    if not found:
        return ""
    names = ", ".join(str(p) for p in found[:3])
    return (
        f"; leftovers of an interrupted dump are next to it: {names} "
        f"(the next `npusnap dump` to {final} cleans them up)"
    )


def dir_is_empty(path: Path) -> bool:
    return not any(path.iterdir())


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _checksummed_files(image: Path) -> list[str]:
    """Relative paths of the files covered by checksums: everything under CHECKSUMMED_SUBDIRS."""
    out: list[str] = []
    for base in (image / d for d in CHECKSUMMED_SUBDIRS):
        for root, _dirs, files in os.walk(base):
            for name in files:
                full = Path(root) / name
                out.append(full.relative_to(image).as_posix())
    return sorted(out)


def device_memory_rel(pid: int) -> str:
    """Where the agent of NPU process ``pid`` wrote its copy of the device memory (in the image)."""
    return f"{DEVICE_SUBDIR}/devmem-{pid}.bin"


def open_device_memory_files(image: Path, manifest: Manifest) -> dict[int, tuple[int, str]]:
    """pid -> (fd read-only, absolute name) of each NPU process's device-memory file that the
    manifest lists; the caller closes the fds. The image was verified (files and checksums)."""
    listed = {f.path for f in manifest.files}
    out: dict[int, tuple[int, str]] = {}
    try:
        for p in manifest.npu_processes:
            rel = device_memory_rel(p.pid)
            if rel in listed:
                path = os.path.abspath(image / rel)
                out[p.pid] = (os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), path)
    except OSError as exc:
        for fd, _path in out.values():
            os.close(fd)
        raise ImageError(
            f"cannot open the image's device-memory file {exc.filename}: {exc.strerror}",
            fix="check the image with `npusnap verify`",
        ) from None
    return out


def file_entries(
    image: Path,
    progress: Optional[ProgressFn] = None,
    known: Optional[Mapping[str, tuple[int, str]]] = None,
) -> tuple[FileEntry, ...]:
    """Digest (digest.DEFAULT) and size of every checksummed file, while a second thread flushes
    them to disk.

    Hashing reads the files back from the page cache (CPU) while fsync waits on the disk, so
    running the two side by side hides most of one behind the other; ``publish`` then finds the
    files already clean. An fsync error (ENOSPC, EIO) is raised here, after the hashing.
    ``known``: {relative path: (size, digest)} already computed while the files were written
    (streamhash.py); a file whose size still matches is not read again.
    """
    rels = _checksummed_files(image)
    seal_modes(image)
    flush_errors: list[OSError] = []

    def flush() -> None:
        try:
            for rel in rels:
                _fsync_path(image / rel)
        except OSError as exc:
            flush_errors.append(exc)

    flusher = threading.Thread(target=flush, name="npusnap-fsync", daemon=True)
    flusher.start()
    try:
        fulls = [image / rel for rel in rels]
        sizes = [f.stat().st_size for f in fulls]
        have = dict(known or {})
        todo = [i for i, (r, n) in enumerate(zip(rels, sizes)) if have.get(r, (-1, ""))[0] != n]
        fresh = dict(zip(todo, digest.of_files([(fulls[i], digest.DEFAULT) for i in todo], progress)))
        if progress is not None:
            progress(sum(n for i, n in enumerate(sizes) if i not in fresh))
        digests = [fresh[i] if i in fresh else have[r][1] for i, r in enumerate(rels)]
        entries = [FileEntry(path=r, size=n, digest=d) for r, n, d in zip(rels, sizes, digests)]
    finally:
        flusher.join()
    if flush_errors:
        raise flush_errors[0]
    return tuple(entries)


def seal_modes(image: Path) -> None:
    """Every file of the image 0600 and every directory 0700, whatever mode CRIU created them with:
    they hold the processes' memory. Walks directory fds, never following a symlink."""
    os.chmod(image, DIR_MODE, follow_symlinks=False)
    for _root, dirs, files, root_fd in os.fwalk(image, follow_symlinks=False):
        for name in dirs + files:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(name, DIR_MODE, dir_fd=root_fd)
            elif stat.S_ISREG(st.st_mode):
                os.chmod(name, FILE_MODE, dir_fd=root_fd)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, then the parent (for the rename)."""
    for cur, dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(cur) / name)
        for name in dirs:
            _fsync_path(Path(cur) / name, directory=True)
    _fsync_path(root, directory=True)


def write_manifest(image: Path, manifest: Manifest) -> bytes:
    """Write ``npusnap.json`` (0600, fsynced); return the bytes written (what a signature covers)."""
    path = manifest_path(image)
    data = manifest.to_json().encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def crash_point(name: str) -> None:
    """Test hook: ``NPUSNAP_TEST_CRASH_AT=name`` SIGKILLs this process here, so that the tests can
    check what a crash at each step of publishing leaves behind. Unset in normal use."""
    if os.environ.get("NPUSNAP_TEST_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically with renameat2(RENAME_EXCHANGE); False where the kernel,
    the C library or the filesystem cannot (the caller falls back to two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(
    tmp: Path, final: Path, manifest: Manifest, *, force: bool = False, sign_key: Optional[Path] = None
) -> Path:
    """Write the manifest into ``tmp``, fsync everything and rename ``tmp`` to ``final``.

    ``final`` may be missing or an empty directory (rename(2) replaces an empty directory
    atomically). A non-empty ``final`` is replaced only with ``force``: with renameat2's
    RENAME_EXCHANGE the new and old image swap places in one step, and the old one (now under
    the work directory's name) is removed; where the kernel cannot exchange, the old image is
    renamed aside first, and a crash between the two renames leaves it where the next dump puts
    it back. At no instant is there a directory named ``final`` that is not a complete image.
    """
    data = write_manifest(tmp, manifest)
    if sign_key is not None:
        from npusnap_cli.image import imagetrust

        imagetrust.write_signature(tmp, data, sign_key)
    fsync_tree(tmp)
    crash_point("publish:before-rename")
    if final.exists() and not dir_is_empty(final):
        if not force:
            raise UsageError(
                f"{final} appeared and is not empty",
                why="something wrote into the target directory during the dump",
                fix="dump into a new directory, or pass --force to replace it",
            )
        if rename_exchange(tmp, final):
            _fsync_path(final.parent, directory=True)
            crash_point("publish:after-exchange")
            remove_tree(tmp)  # the old image, under the work directory's name
            return final
        old = final.parent / f".{final.name}{OLD_MARKER}{os.getpid()}"
        os.rename(final, old)
        crash_point("publish:between-renames")
        os.rename(tmp, final)
        _fsync_path(final.parent, directory=True)
        remove_tree(old)
        return final
    os.rename(tmp, final)
    _fsync_path(final.parent, directory=True)
    return final


def remove_tree(path: Path) -> None:
    """Remove a partial image this run made; never raises (the caller is handling a failure).

    It walks through directory fds without following symlinks, and never changes a mode: a
    chmod of a parent to get past an error would be one a planted name could aim elsewhere.
    """
    try:
        parent_fd = _open_parent(path.parent)
    except OSError:
        return
    try:
        st = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(parent_fd, path.name, st)
    except OSError:
        pass
    finally:
        os.close(parent_fd)


FAILED_LOGS_SUFFIX = ".failed-logs"


def failed_logs_dir(final: Path) -> Path:
    """Where a failed run's logs are kept: beside the image it was writing, named after it
    (``IMG.failed-logs``), so that an operator finds them where the image should have been."""
    return final.parent / f"{final.name}{FAILED_LOGS_SUFFIX}"


def _final_of(tmp: Path) -> Optional[Path]:
    name = tmp.name
    if name.startswith(".") and TMP_MARKER in name:
        return tmp.parent / name[1 : name.index(TMP_MARKER)]
    return None


def save_failure_logs(tmp: Path, label: str) -> Optional[Path]:
    """Move the logs of a failed run out of a partial image (which is then removed).

    They go beside the image's final path, into ``IMG.failed-logs`` (the previous failure's are
    replaced: one directory per image, not an ever-growing pile); where that is not possible (the
    name is taken by something else), into a new directory under ``$TMPDIR/npusnap-logs``
    (hostclean.new_log_dir: the base is checked to be a private directory of this user, the new
    one is made by mkdtemp, so that a name planted in a shared /tmp cannot redirect them; old
    ones are pruned). The partial image itself must not stay (it would look like an image).
    """
    src = logs_dir(tmp)
    if not src.is_dir() or src.is_symlink() or dir_is_empty(src):
        return None
    final = _final_of(tmp)
    if final is not None:
        dest = failed_logs_dir(final)
        try:
            st = os.lstat(dest)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                remove_tree(dest)
        except FileNotFoundError:
            pass
        except OSError:
            final = None
        if final is not None:
            try:
                # Same filesystem as the partial image: a rename, atomic, nothing copied.
                os.rename(src, dest)
                return dest
            except OSError:
                pass
    from npusnap_cli.host import hostclean

    try:
        dest = hostclean.new_log_dir(label)
        for entry in os.scandir(src):
            if entry.is_file(follow_symlinks=False):
                # shutil.move: /tmp is often another filesystem than the image's (rename: EXDEV)
                shutil.move(entry.path, str(dest / entry.name))
        return dest
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Reading and verifying
# --------------------------------------------------------------------------------------------


def follow_pointer(path: Path) -> Path:
    """The image a pointer names: ``latest`` (dump --latest) is a symlink to the newest image.

    Resolved once, where a command takes its argument, so that every later step uses the one real
    path (what was verified is what is restored); a symlink met anywhere later is refused.
    """
    p = Path(os.path.abspath(path))
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _check_image_dir(image: Path) -> None:
    try:
        st = os.lstat(image)
    except OSError:
        raise ImageError(
            f"no image at {image}{leftovers_hint(image)}",
            why="the directory does not exist",
            fix="check the path; `npusnap dump PID DIR` writes an image",
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise ImageError(
            f"refusing {image}: it is a symbolic link",
            why="an image is used only through its real path, so that what was verified is what is restored",
            fix=f"pass its real path: $(realpath {image})",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{image} is not a directory", fix="pass the image directory that dump created")
    if is_temp_name(image.name):
        raise ImageError(
            f"{image} is not an image: it is the work directory of a dump that did not finish",
            why="dump builds an image under a hidden work name and renames it to DIR only when it is "
            "complete; a directory still under that name was never published",
            fix="dump again; the next `npusnap dump` to the same DIR removes it",
        )


def read_manifest_bytes(image: Path) -> bytes:
    """The manifest's bytes, read without following a symlink or blocking on a FIFO."""
    _check_image_dir(image)
    path = manifest_path(image)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ImageError(
            f"{image} is not an npusnap image: {MANIFEST_NAME} is missing",
            why="the dump did not finish, or this is not an image directory",
            fix="dump again; only directories that `npusnap dump` completed hold a manifest",
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ImageError(
                f"refusing {path}: it is a symbolic link",
                why="an image holds only directories and regular files",
                fix="do not use this image; dump again",
            ) from None
        raise ImageError(f"cannot read {path}: {exc.strerror}", fix="check the file's permissions") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(
                f"refusing {path}: it is {_kind(st.st_mode)}", fix="do not use this image; dump again"
            )
        from npusnap_cli.image.imagetrust import MAX_MANIFEST_BYTES

        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ImageError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes", fix="do not use this image")
    return data


def load_manifest(image: Path) -> Manifest:
    return _parse_manifest(image, read_manifest_bytes(image))


def _parse_manifest(image: Path, data: bytes) -> Manifest:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ImageError(f"{manifest_path(image)} is not UTF-8: {exc}", fix="do not use this image") from None
    return Manifest.from_json(text)


@dataclass(frozen=True)
class VerifyResult:
    image: str
    manifest: Manifest
    files_checked: int
    bytes_checked: int
    checksums: bool
    signed: bool = False  # the signature was required and is valid
    leftovers: tuple[str, ...] = ()  # work directories / set-aside images of interrupted dumps

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "ok": True,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "checksums": self.checksums,
            "signed": self.signed,
            "leftovers": list(self.leftovers),
        }


def verification_error(image: Path, problems: list[str]) -> ImageError:
    """The error of an image whose files are not what its manifest lists (problems[0] named)."""
    return ImageError(
        f"image {image} failed verification: {problems[0]}",
        why="the image is truncated, was modified after the dump, or the disk is corrupt",
        fix="do not restore it; dump the process again (or copy the image again from its source)",
        details={"problems": problems},
    )


def verify(
    image: Path,
    *,
    checksums: bool = True,
    progress: Optional[ProgressFn] = None,
    require_signature: Optional[Path] = None,
) -> VerifyResult:
    """Check that ``image`` may be trusted and is complete (docs/image-format.md, "Trust model"):
    a real directory of regular files owned by this user or root and writable by nobody else,
    the manifest against its schema and against the files, the signature (with
    ``require_signature``) and, unless ``checksums=False``, every file's checksum.

    Raises ImageError naming the first problem (all problems are in ``details``).
    """
    from npusnap_cli.image import imagetrust

    data = read_manifest_bytes(image)
    manifest = _parse_manifest(image, data)
    imagetrust.check_tree(image)
    imagetrust.check_ownership(image)
    imagetrust.check_manifest(manifest)
    if require_signature is not None:
        imagetrust.check_signature(image, data, require_signature)
    problems: list[str] = []
    if not criu_dir(image).is_dir():
        problems.append(f"{CRIU_SUBDIR}/ is missing")
        raise verification_error(image, problems)
    if not manifest.files:
        problems.append("the manifest lists no files")
    listed = {f.path for f in manifest.files}
    by_path = {f.path: f for f in manifest.files}
    from npusnap_cli.host import hostres

    problems += hostres.check_host_files(
        manifest.host_files, {p.uid for p in manifest.processes}, manifest.host_nodes
    )
    for hf in manifest.host_files:
        entry = by_path.get(hf.rel)
        if entry is None or (entry.algo, entry.digest, entry.size) != (hf.algo, hf.digest, hf.size):
            problems.append(f"host file {hf.path} does not match its copy {hf.rel} in the manifest")
    for rel in _checksummed_files(image):
        if rel not in listed:
            problems.append(f"unexpected file {rel} (not in the manifest)")
    present: list[FileEntry] = []
    for entry in manifest.files:
        full = image / entry.path
        if not full.is_file():
            problems.append(f"{entry.path} is missing")
            continue
        size = full.stat().st_size
        if size != entry.size:
            problems.append(f"{entry.path} has {size} bytes, the manifest says {entry.size}")
            continue
        present.append(entry)
    good = present
    if checksums:
        digests = digest.of_files([(image / e.path, e.algo) for e in present], progress)
        good = [e for e, d in zip(present, digests) if d == e.digest]
        problems += [digest.mismatch(e.path, e.algo) for e, d in zip(present, digests) if d != e.digest]
    checked = len(good)
    nbytes = sum(e.size for e in good)
    if problems:
        raise verification_error(image, problems)
    return VerifyResult(
        image=str(image),
        manifest=manifest,
        files_checked=checked,
        bytes_checked=nbytes,
        checksums=checksums,
        signed=require_signature is not None,
        leftovers=tuple(str(p) for p in temp_siblings(image)),
    )


def check_dump_target(final: Path, *, force: bool) -> None:
    """DIR must be new or an empty directory (or anything, with ``force``), in a writable place."""
    if is_temp_name(final.name):
        raise UsageError(
            f"{final.name} is named like an npusnap work directory ({TMP_MARKER}, {OLD_MARKER})",
            why="such names are never images: verify refuses them, later dumps clean them up",
            fix="choose another name for the image",
        )
    if final.exists() or final.is_symlink():
        if not final.is_dir():
            raise UsageError(
                f"{final} exists and is not a directory",
                why="dump writes a directory",
                fix="choose a new path for the image",
            )
        if not force and not dir_is_empty(final):
            raise UsageError(
                f"{final} exists and is not empty",
                why="npusnap never overwrites a directory without being told to",
                fix="choose a new directory, or pass --force to replace its content",
            )
    parent = final.parent
    probe: Path = parent
    while not probe.exists():
        probe = probe.parent
    with contextlib.suppress(OSError):
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            raise UsageError(
                f"cannot write the image to {final}: {probe} is on a read-only filesystem",
                fix="choose a directory on a writable filesystem",
            )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(
            f"cannot write the image next to {final}: {probe} is not writable",
            fix="choose a directory you can write to",
        )


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize
