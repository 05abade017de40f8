"""The image directory: its layout, the manifest (``npusnap.json``), checksums and atomic publishing.

Every name inside an image is a constant here, and nowhere else::

    DIR/                  mode 0700: it holds the processes' memory, i.e. their secrets
      npusnap.json        the manifest (schema below)
      criu/               CRIU's image files (pages, core, fdinfo, ...)
      hostfiles/          copies of tmpfs files the tree had open or mapped (/dev/shm ...), by path
      logs/               CRIU's dump/restore logs and stats (not checksummed: restore writes here)

An image is built in a temporary sibling (``.DIR.npusnap-tmp-*``), fsynced (files, then
directories) and renamed into place only when complete, so a crash never leaves a directory that
looks like a finished image. ``verify`` checks schema, structure and every file's sha256.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.hostres import ExternalStdio, HostFile

SCHEMA_VERSION = 1
MANIFEST_NAME = "npusnap.json"
CRIU_SUBDIR = "criu"
LOGS_SUBDIR = "logs"
HOSTFILES_SUBDIR = "hostfiles"
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
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProcessEntry:
        w = f"processes[{d.get('pid', '?')}]"
        return cls(
            pid=_req(d, "pid", int, w),
            ppid=_req(d, "ppid", int, w),
            cmdline=tuple(str(a) for a in _req(d, "cmdline", list, w)),
            uid=_req(d, "uid", int, w),
            agent=_req(d, "agent", bool, w),
            npu=_req(d, "npu", bool, w),
            devices=tuple(int(x) for x in _req(d, "devices", list, w)),
            device_bytes=_req(d, "device_bytes", int, w),
            agent_socket=_opt(d, "agent_socket", str, w),
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

    def to_dict(self) -> dict[str, Optional[float]]:
        return {k: (None if v is None else round(v, 6)) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timings:
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
        return cls(**{k: _req(d, k, int, "bytes") for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the image directory, '/'-separated
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FileEntry:
        entry = cls(
            path=_req(d, "path", str, "files"),
            size=_req(d, "size", int, "files"),
            sha256=_req(d, "sha256", str, "files"),
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
    schema: int = SCHEMA_VERSION
    # tmpfs files the tree had open or mapped, saved under hostfiles/ (see hostres.py).
    host_files: tuple[HostFile, ...] = ()
    # Pipes to processes outside the tree, recorded with --external-pipes (restore --pipe-to).
    external_stdio: tuple[ExternalStdio, ...] = ()

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
            "files": [f.to_dict() for f in self.files],
            "host_files": [f.to_dict() for f in self.host_files],
            "external_stdio": [e.to_dict() for e in self.external_stdio],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        if not isinstance(d, Mapping):
            raise ImageError("the manifest is not a JSON object", fix="dump again")
        schema = _req(d, "schema", int, "manifest")
        if schema != SCHEMA_VERSION:
            raise ImageError(
                f"unsupported image schema {schema} (this npusnap reads schema {SCHEMA_VERSION})",
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
            processes=tuple(ProcessEntry.from_dict(p) for p in _req(d, "processes", list, "manifest")),
            timings=Timings.from_dict(_req(d, "timings", dict, "manifest")),
            bytes=ByteCounts.from_dict(_req(d, "bytes", dict, "manifest")),
            criu_options=dict(_req(d, "criu_options", dict, "manifest")),
            files=tuple(FileEntry.from_dict(f) for f in _req(d, "files", list, "manifest")),
            host_files=tuple(HostFile.from_dict(f) for f in _opt(d, "host_files", list, "manifest") or ()),
            external_stdio=tuple(
                ExternalStdio.from_dict(e) for e in _opt(d, "external_stdio", list, "manifest") or ()
            ),
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ImageError(
                f"{MANIFEST_NAME} is not valid JSON: {exc}",
                why="the image is truncated or was edited",
                fix="do not use this image; dump again",
            ) from None
        return cls.from_dict(data)


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
    """Leftover temporary siblings of ``final`` (from this or an interrupted earlier run)."""
    parent = final.parent
    prefix = f".{final.name}{TMP_MARKER}"
    try:
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefix))
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


def remove_stale_temps(final: Path) -> list[Path]:
    """Remove work areas next to ``final`` left by dumps whose process is gone (killed, crashed)."""
    removed = []
    for tmp in temp_siblings(final):
        rest = tmp.name[len(f".{final.name}{TMP_MARKER}") :]
        pid_text = rest.split("-", 1)[0]
        if pid_text.isdigit() and not os.path.exists(f"/proc/{pid_text}"):
            remove_tree(tmp)
            removed.append(tmp)
    return removed


def dir_is_empty(path: Path) -> bool:
    return not any(path.iterdir())


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def sha256_file(path: Path, progress: Optional[ProgressFn] = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def sha256_files(paths: list[Path], progress: Optional[ProgressFn] = None) -> list[str]:
    """sha256 of each file, several at a time: an image holds one pages file per process of the
    tree (eight NPU ranks make eight large files), and hashlib releases the GIL while it hashes.
    """
    if len(paths) <= 1:
        return [sha256_file(p, progress) for p in paths]
    lock = threading.Lock()

    def locked(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    workers = min(len(paths), os.cpu_count() or 1, 8)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="npusnap-sha") as pool:
        return list(pool.map(lambda p: sha256_file(p, locked), paths))


def _checksummed_files(image: Path) -> list[str]:
    """Relative paths of the files covered by checksums: everything under criu/ and hostfiles/."""
    out: list[str] = []
    for base in (criu_dir(image), image / HOSTFILES_SUBDIR):
        for root, _dirs, files in os.walk(base):
            for name in files:
                full = Path(root) / name
                out.append(full.relative_to(image).as_posix())
    return sorted(out)


def file_entries(image: Path, progress: Optional[ProgressFn] = None) -> tuple[FileEntry, ...]:
    """sha256 and size of every checksummed file, while a second thread flushes them to disk.

    Hashing reads the files back from the page cache (CPU) while fsync waits on the disk, so
    running the two side by side hides most of one behind the other; ``publish`` then finds the
    files already clean. An fsync error (ENOSPC, EIO) is raised here, after the hashing.
    """
    rels = _checksummed_files(image)
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
        digests = sha256_files(fulls, progress)
        entries = [FileEntry(path=r, size=n, sha256=d) for r, n, d in zip(rels, sizes, digests)]
    finally:
        flusher.join()
    if flush_errors:
        raise flush_errors[0]
    return tuple(entries)


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


def write_manifest(image: Path, manifest: Manifest) -> None:
    path = manifest_path(image)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path, manifest: Manifest, *, force: bool = False) -> Path:
    """Write the manifest into ``tmp``, fsync everything and rename ``tmp`` to ``final``.

    ``final`` may be missing or an empty directory (rename(2) replaces an empty directory
    atomically). A non-empty ``final`` is replaced only with ``force``: it is first renamed
    aside, then removed once the new image is in place.
    """
    write_manifest(tmp, manifest)
    fsync_tree(tmp)
    old: Optional[Path] = None
    if final.exists() and not dir_is_empty(final):
        if not force:
            raise UsageError(
                f"{final} appeared and is not empty",
                why="something wrote into the target directory during the dump",
                fix="dump into a new directory, or pass --force to replace it",
            )
        old = final.parent / f".{final.name}{OLD_MARKER}{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(final.parent, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_tree(path: Path) -> None:
    """Remove a partial image; never raises (the caller is already handling a failure)."""

    def _onerror(func: Any, p: str, exc: Any) -> None:
        # A read-only directory entry would stop rmtree: make it writable and retry once.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            func(p)

    if not path.exists():
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_onerror)
    else:
        shutil.rmtree(path, onerror=_onerror)


def save_failure_logs(tmp: Path, label: str) -> Optional[Path]:
    """Move the logs of a failed run out of a partial image (which is then removed).

    They go to ``$TMPDIR/npusnap-logs/<label>-<time>-<pid>/`` so that the error can point at
    them; the partial image itself must not stay (it would look like an image).
    """
    src = logs_dir(tmp)
    if not src.is_dir() or dir_is_empty(src):
        return None
    base = Path(tempfile.gettempdir()) / "npusnap-logs"
    try:
        base.mkdir(mode=DIR_MODE, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        dest = base / f"{label}-{stamp}-{os.getpid()}"
        shutil.move(str(src), str(dest))
        os.chmod(dest, DIR_MODE)
        return dest
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Reading and verifying
# --------------------------------------------------------------------------------------------


def load_manifest(image: Path) -> Manifest:
    if not image.exists():
        raise ImageError(
            f"no image at {image}",
            why="the directory does not exist",
            fix="check the path; `npusnap dump PID DIR` writes an image",
        )
    if not image.is_dir():
        raise ImageError(f"{image} is not a directory", fix="pass the image directory that dump created")
    path = manifest_path(image)
    if not path.is_file():
        hint = " (it looks like an unfinished dump's work area)" if is_temp_name(image.name) else ""
        raise ImageError(
            f"{image} is not an npusnap image: {MANIFEST_NAME} is missing{hint}",
            why="the dump did not finish, or this is not an image directory",
            fix="dump again; only directories that `npusnap dump` completed hold a manifest",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ImageError(f"cannot read {path}: {exc}", fix="check the file's permissions") from None
    return Manifest.from_json(text)


@dataclass(frozen=True)
class VerifyResult:
    image: str
    manifest: Manifest
    files_checked: int
    bytes_checked: int
    checksums: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "ok": True,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "checksums": self.checksums,
        }


def _problem_error(image: Path, problems: list[str]) -> ImageError:
    return ImageError(
        f"image {image} failed verification: {problems[0]}",
        why="the image is truncated, was modified after the dump, or the disk is corrupt",
        fix="do not restore it; dump the process again (or copy the image again from its source)",
        details={"problems": problems},
    )


def verify(image: Path, *, checksums: bool = True, progress: Optional[ProgressFn] = None) -> VerifyResult:
    """Check the manifest schema, the structure and (unless ``checksums=False``) every sha256.

    Raises ImageError naming the first mismatching file (all problems are in ``details``).
    """
    manifest = load_manifest(image)
    problems: list[str] = []
    if not criu_dir(image).is_dir():
        problems.append(f"{CRIU_SUBDIR}/ is missing")
        raise _problem_error(image, problems)
    if not manifest.files:
        problems.append("the manifest lists no files")
    if not manifest.processes:
        problems.append("the manifest lists no processes")
    listed = {f.path for f in manifest.files}
    by_path = {f.path: f for f in manifest.files}
    for hf in manifest.host_files:
        entry = by_path.get(hf.rel)
        if entry is None or entry.sha256 != hf.sha256 or entry.size != hf.size:
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
        digests = sha256_files([image / e.path for e in present], progress)
        good = [e for e, d in zip(present, digests) if d == e.sha256]
        problems += [
            f"{e.path} does not match its sha256 (file modified)"
            for e, d in zip(present, digests)
            if d != e.sha256
        ]
    checked = len(good)
    nbytes = sum(e.size for e in good)
    if problems:
        raise _problem_error(image, problems)
    return VerifyResult(
        image=str(image), manifest=manifest, files_checked=checked, bytes_checked=nbytes, checksums=checksums
    )


def check_dump_target(final: Path, *, force: bool) -> None:
    """DIR must be new or an empty directory (or anything, with ``force``), in a writable place."""
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
