"""The manifest (``npusnap.json``): its schema, how it is read and checked, how it is written.

A manifest is checked, not merely read: every field against its type, no field the schema does
not have, its own sha256 (``manifest_sha256``) against its content, and the records it carries
(processes, files, host files, pid namespace). A problem is an ImageError naming the field; a
manifest of another schema version is an IncompatibleImageError.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TypeVar, cast

from npusnap_cli.criu.options import CriuOptionsRecord
from npusnap_cli.errors import ImageError, IncompatibleImageError
from npusnap_cli.image import digest, imagetrust
from npusnap_cli.image.hostrecords import ExternalStdio, HostFile, HostNode
from npusnap_cli.image.layout import (
    FILE_MODE,
    MANIFEST_NAME,
    check_image_dir,
    device_memory_rel,
    kind_of,
    manifest_path,
)
from npusnap_cli.jsontypes import JSONObject, JSONValue

# 2: an NPU process's device memory may be kept as shared chunks with an index
# (devchunks.py) instead of one file; schema 1 images (one file each) are read as they were.
SCHEMA_VERSION = 2
SCHEMAS_READ = (1, 2)

ProgressFn = Callable[[int], None]
T = TypeVar("T")
# A manifest's object, as json.loads gives it (checked field by field by the helpers below).
_Obj = Mapping[str, JSONValue]


def _req(data: _Obj, key: str, kind: type[T], where: str) -> T:
    if key not in data:
        raise ImageError(
            f"manifest field {where}.{key} is missing",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    value = data[key]
    # bool is an int: refuse it where a number is meant
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ImageError(
            f"manifest field {where}.{key} has the wrong type ({type(value).__name__})",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    return value


def _opt(data: _Obj, key: str, kind: type[T], where: str) -> Optional[T]:
    if data.get(key) is None:
        return None
    return _req(data, key, kind, where)


def _opt_number(data: _Obj, key: str, where: str) -> Optional[float]:
    """A JSON number (an integer too) as a float, or None when absent or null."""
    if data.get(key) is None:
        return None
    if isinstance(data[key], int) and not isinstance(data[key], bool):
        return float(_req(data, key, int, where))
    return _req(data, key, float, where)


def _only(data: _Obj, keys: Collection[str], where: str) -> None:
    """Refuse fields the schema does not have (a manifest is checked, not merely read)."""
    extra = sorted(str(k) for k in data if k not in keys)
    if extra:
        raise ImageError(
            f"manifest field {where}.{extra[0]} is not part of schema {SCHEMA_VERSION}",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )


def _list_of(data: _Obj, key: str, kind: type[T], where: str) -> list[T]:
    out: list[T] = []
    for item in _req(data, key, list, where):
        if not isinstance(item, kind) or (isinstance(item, bool) and kind is not bool):
            raise ImageError(
                f"manifest field {where}.{key} holds a {type(item).__name__}, not a {kind.__name__}",
                why="the manifest was written by another tool or edited by hand",
                fix="use an image written by this npusnap version, or dump again",
            )
        out.append(item)
    return out


def _objects(data: _Obj, key: str, where: str, *, optional: bool = False) -> list[JSONValue]:
    """The array ``data[key]`` (each item is checked by its record's from_dict)."""
    items = _opt(data, key, list, where) if optional else _req(data, key, list, where)
    return list(items or ())


def _records(data: _Obj, key: str, where: str) -> list[_Obj]:
    """The optional array of objects ``data[key]`` (each checked by its record's from_dict)."""
    out = []
    for item in _objects(data, key, where, optional=True):
        if not isinstance(item, Mapping):
            raise ImageError(f"manifest field {key} holds a non-object", fix="dump again")
        out.append(item)
    return out


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

    def to_dict(self) -> JSONObject:
        return {
            "tool": self.tool,
            "criu": self.criu,
            "cann": self.cann,
            "cann_simulated": self.cann_simulated,
            "python": self.python,
            "cann_home": self.cann_home,
        }

    @classmethod
    def from_dict(cls, d: _Obj) -> Versions:
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

    def to_dict(self) -> JSONObject:
        return {"hostname": self.hostname, "kernel": self.kernel, "machine": self.machine}

    @classmethod
    def from_dict(cls, d: _Obj) -> HostInfo:
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
    # ASCEND_RT_VISIBLE_DEVICES as the process saw it: the runtime keeps the list it read at init,
    # so a restored copy reaches the same driver ids whatever device it is restored "onto".
    visible_devices: Optional[str] = None
    # An exited child its parent had not reaped: CRIU dumps it and restores it as a zombie.
    zombie: bool = False

    def to_dict(self) -> JSONObject:
        d = self._fields()
        if self.visible_devices is not None:  # absent unless set: the common manifest is unchanged
            d["visible_devices"] = self.visible_devices
        if self.zombie:  # likewise
            d["zombie"] = True
        return d

    def _fields(self) -> JSONObject:
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
    def from_dict(cls, d: JSONValue) -> ProcessEntry:
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
            visible_devices=_opt(d, "visible_devices", str, w),
            zombie=bool(_opt(d, "zombie", bool, w)),
        )


@dataclass(frozen=True)
class Timings:
    """Per-phase durations of a dump, in seconds (None: the phase did not run)."""

    preflight_s: Optional[float] = None
    lock_s: Optional[float] = None
    backup_s: Optional[float] = None
    # npusnap's copy of the device memory (inside the agents' lock): not the runtime's Lock.
    device_copy_s: Optional[float] = None
    # After Lock, the wait for the job's device work already queued (the longest of its
    # processes): the job's own computing finishing, inside frozen_s, apart from the copy.
    drain_s: Optional[float] = None
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
    def from_dict(cls, d: _Obj) -> Timings:
        _only(d, cls.__dataclass_fields__, "timings")
        return cls(**{k: _opt_number(d, k, "timings") for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ByteCounts:
    device_bytes: int = 0
    image_bytes: int = 0
    criu_pages_bytes: int = 0
    # The device-memory streams the image holds, and of those the bytes this dump wrote (the
    # rest are chunks linked from earlier images: devchunks.py). Absent before schema 2.
    device_total: int = 0
    device_new: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: _Obj) -> ByteCounts:
        _only(d, cls.__dataclass_fields__, "bytes")
        optional = ("device_total", "device_new")
        values = {k: _req(d, k, int, "bytes") for k in cls.__dataclass_fields__ if k not in optional}
        values.update({k: _opt(d, k, int, "bytes") or 0 for k in optional})
        return cls(**values)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the image directory, '/'-separated
    size: int
    digest: str  # hex, of the algorithm ``algo`` (digest.py)
    algo: str = _DEFAULT_ALGO

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "size": self.size, self.algo: self.digest}

    @classmethod
    def from_dict(cls, d: JSONValue) -> FileEntry:
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
    criu_options: CriuOptionsRecord = field(default_factory=lambda: CriuOptionsRecord())
    files: tuple[FileEntry, ...] = ()
    leave_running: bool = False
    # {"mode": preserve|app|discard, "continuity": npusnap|application|lost, "processes": {...}}
    # (docs/device-memory.md); empty in images made before npusnap kept device memory.
    device_memory: Mapping[str, JSONValue] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    # tmpfs files the tree had open or mapped, saved under hostfiles/ (see host/hostres/).
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

    def to_dict(self) -> JSONObject:
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
            # A TypedDict is no Mapping[str, JSONValue] to mypy; every value of it is JSON.
            "criu_options": cast(JSONObject, dict(self.criu_options)),
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
    def from_dict(cls, d: JSONValue) -> Manifest:
        if not isinstance(d, Mapping):
            raise ImageError("the manifest is not a JSON object", fix="dump again")
        _only(d, set(cls.__dataclass_fields__), "manifest")
        schema = _req(d, "schema", int, "manifest")
        if schema not in SCHEMAS_READ:
            raise IncompatibleImageError(
                f"unsupported image schema {schema} (this npusnap reads schemas "
                f"{', '.join(map(str, SCHEMAS_READ))})",
                why="the image was written by a different npusnap version",
                fix="restore it with the npusnap version that wrote it (see versions.tool in npusnap.json)",
            )
        return cls(
            schema=schema,
            created_at=_req(d, "created_at", str, "manifest"),
            versions=Versions.from_dict(_req(d, "versions", dict, "manifest")),
            host=HostInfo.from_dict(_req(d, "host", dict, "manifest")),
            root_pid=_req(d, "root_pid", int, "manifest"),
            leave_running=_req(d, "leave_running", bool, "manifest"),
            processes=tuple(ProcessEntry.from_dict(p) for p in _objects(d, "processes", "manifest")),
            timings=Timings.from_dict(_req(d, "timings", dict, "manifest")),
            bytes=ByteCounts.from_dict(_req(d, "bytes", dict, "manifest")),
            criu_options=_criu_options(_req(d, "criu_options", dict, "manifest")),
            files=tuple(FileEntry.from_dict(f) for f in _objects(d, "files", "manifest")),
            host_files=tuple(HostFile.from_dict(f) for f in _records(d, "host_files", "manifest")),
            external_stdio=tuple(
                ExternalStdio.from_dict(e) for e in _records(d, "external_stdio", "manifest")
            ),
            device_memory=_device_memory(d.get("device_memory")),
            host_nodes=tuple(HostNode.from_dict(n) for n in _records(d, "host_nodes", "manifest")),
            pid_ns=check_pid_ns(d.get("pid_ns")),
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
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
    "passthrough": (list,),
}


def _criu_options(d: _Obj) -> CriuOptionsRecord:
    _only(d, _CRIU_OPTION_TYPES, "criu_options")
    for key, value in d.items():
        types = _CRIU_OPTION_TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ImageError(f"manifest field criu_options.{key} has the wrong type", fix="dump again")
    for key in ("external", "passthrough"):
        if any(not isinstance(x, str) for x in _opt(d, key, list, "criu_options") or []):
            raise ImageError(f"manifest field criu_options.{key} holds a non-string", fix="dump again")
    # Every key and its type checked above: the record as CriuOptions.to_dict() wrote it.
    return cast(CriuOptionsRecord, dict(d))


def _device_memory(value: JSONValue) -> dict[str, JSONValue]:
    """The manifest's ``device_memory`` (docs/device-memory.md): an object, empty when absent."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImageError(
            f"manifest field manifest.device_memory has the wrong type ({type(value).__name__})",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    return dict(value)


def _self_hash(d: _Obj) -> str:
    """sha256 of the manifest's canonical JSON form (sorted keys, no spaces) without this field."""
    canon = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def check_pid_ns(d: JSONValue) -> dict[str, int]:
    """The manifest's ``pid_ns`` (host pid as a string -> namespace pid), validated."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ImageError(f"bad pid_ns in the manifest: {d!r}", fix="dump again")
    pid_ns = {k: v for k, v in d.items() if k.isdigit() and isinstance(v, int) and v > 0}
    if len(pid_ns) != len(d):
        raise ImageError(f"bad pid_ns in the manifest: {d!r}", fix="dump again")
    if pid_ns and 1 not in pid_ns.values():
        raise ImageError("the manifest's pid_ns has no namespace init (pid 1)", fix="dump again")
    return pid_ns


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def read_manifest_bytes(image: Path, *, unpublished: bool = False) -> bytes:
    """The manifest's bytes, read without following a symlink or blocking on a FIFO."""
    check_image_dir(image, unpublished=unpublished)
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
        if isinstance(exc, PermissionError):
            raise  # not the image's fault: the CLI says which permission (or root) is missing
        raise ImageError(f"cannot read {path}: {exc.strerror}", fix="check the file's permissions") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(
                f"refusing {path}: it is {kind_of(st.st_mode)}", fix="do not use this image; dump again"
            )
        data = f.read(imagetrust.MAX_MANIFEST_BYTES + 1)
    if len(data) > imagetrust.MAX_MANIFEST_BYTES:
        raise ImageError(
            f"{path} is larger than {imagetrust.MAX_MANIFEST_BYTES} bytes", fix="do not use this image"
        )
    return data


def load_manifest(image: Path) -> Manifest:
    return parse_manifest(image, read_manifest_bytes(image))


def parse_manifest(image: Path, data: bytes) -> Manifest:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ImageError(f"{manifest_path(image)} is not UTF-8: {exc}", fix="do not use this image") from None
    return Manifest.from_json(text)


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
