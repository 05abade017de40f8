"""What npusnap leaves on a host, and removing it once it is no longer needed.

Three kinds of debris:

* **agent sockets** in the runtime directory (``/run/npusnap/<pid>.sock``) whose process is
  gone: an agent removes its socket when its interpreter exits normally, but not when the process
  is killed (a CRIU dump kills it on purpose). A socket is stale when nothing listens on it and
  its pid is dead, or that pid now belongs to a process started after the socket was made;
* **failure logs** under ``$TMPDIR/npusnap-logs/`` (CRIU logs of failed dumps, restore logs of
  read-only images): kept for a person to read, bounded to the newest ``KEEP_LOGS`` and to
  ``MAX_LOG_AGE_S``;
* **demo work directories** ``$TMPDIR/npusnap-demo-*``: removed by the demo itself unless
  ``--keep``; ``npusnap check`` reports ones that are left.

Core module: never prints. ``npusnap check`` reports what it finds (``debris_report``); the CLI
removes stale sockets when it looks for agents, and new failure logs prune the old ones.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from npusnap_cli import paths
from npusnap_cli.host import procfs
from npusnap_cli.image import layout

KEEP_LOGS = 20  # failure-log directories kept (the newest)
MAX_LOG_AGE_S = 14 * 24 * 3600  # and none older than two weeks
DEMO_PREFIX = "npusnap-demo-"
# A socket made within this many seconds before its pid's start time still counts as that
# process's (/proc start times have clock-tick resolution, file times are rounded differently).
START_SLACK_S = 1.0


def log_base() -> Path:
    """Where logs of failed runs go: ``$TMPDIR/npusnap-logs`` (0700)."""
    return Path(tempfile.gettempdir()) / "npusnap-logs"


def new_log_dir(label: str) -> Path:
    """A new, private directory for one run's logs; prunes old ones first."""
    base = log_base()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        # In a shared /tmp the fixed name may be someone else's (a planted symlink or directory):
        # never follow it; a fresh directory of our own next to it keeps the logs all the same.
        return Path(tempfile.mkdtemp(prefix=f"npusnap-{label}-logs-{stamp}-"))
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(base, 0o700)  # ours and a real directory (lstat): make it private
    prune_failure_logs()
    return Path(tempfile.mkdtemp(prefix=f"{label}-{stamp}-", dir=base))


def save_failure_logs(tmp: Path, label: str) -> Optional[Path]:
    """Move the logs of a failed run out of a partial image (which is then removed).

    They go beside the image's final path, into ``IMG.failed-logs`` (the previous failure's are
    replaced: one directory per image, not an ever-growing pile); where that is not possible (the
    name is taken by something else), into a new directory under ``$TMPDIR/npusnap-logs``
    (new_log_dir: the base is checked to be a private directory of this user, the new
    one is made by mkdtemp, so that a name planted in a shared /tmp cannot redirect them; old
    ones are pruned). The partial image itself must not stay (it would look like an image).
    """
    src = layout.logs_dir(tmp)
    if not src.is_dir() or src.is_symlink() or layout.dir_is_empty(src):
        return None
    final = layout.final_of(tmp)
    if final is not None:
        dest = layout.failed_logs_dir(final)
        try:
            st = os.lstat(dest)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                layout.remove_tree(dest)
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
    try:
        dest = new_log_dir(label)
        for entry in os.scandir(src):
            if entry.is_file(follow_symlinks=False):
                # shutil.move: /tmp is often another filesystem than the image's (rename: EXDEV)
                shutil.move(entry.path, str(dest / entry.name))
        return dest
    except OSError:
        return None


def failure_logs() -> list[Path]:
    """The log directories under ``log_base()``, newest first; none when that name is not a
    directory of this user's (someone else's symlink or directory in a shared /tmp: what is in
    there is theirs, and pruning it would delete their files)."""
    base = log_base()
    try:
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return []
        entries = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    return sorted(entries, key=_mtime, reverse=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def prune_failure_logs(keep: int = KEEP_LOGS, max_age_s: float = MAX_LOG_AGE_S) -> list[Path]:
    """Remove all but the newest ``keep`` log directories, and any older than ``max_age_s``."""
    now = time.time()
    removed = []
    for i, path in enumerate(failure_logs()):
        if i >= keep or now - _mtime(path) > max_age_s:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------
# Agent sockets
# --------------------------------------------------------------------------------------------


def _boot_time() -> float:
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_start_time(pid: int) -> Optional[float]:
    """When ``pid`` started (epoch seconds), or None if it does not exist."""
    ticks = procfs.start_time(pid)
    if ticks is None:
        return None
    try:
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class StaleSocket:
    path: str
    pid: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "pid": self.pid, "reason": self.reason}


def _socket_dirs() -> list[Path]:
    dirs = [paths.agent_runtime_dir()]
    return [d for d in dirs if d.is_dir()]


def _pid_files(directories: Optional[list[Path]], suffix: str) -> Iterator[tuple[Path, int, os.stat_result]]:
    """``PID<suffix>`` entries of the agent runtime directories (or ``directories``), not followed."""
    for directory in directories if directories is not None else _socket_dirs():
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            stem = name.removesuffix(suffix)
            if not name.endswith(suffix) or not stem.isdigit():
                continue
            path = directory / name
            try:
                st = path.lstat()
            except OSError:
                continue
            yield path, int(stem), st


def stale_agent_sockets(directories: Optional[list[Path]] = None) -> list[StaleSocket]:
    """Agent sockets whose process is gone (or is another process now) and that nobody serves."""
    listening = set(paths.listening_unix_paths())
    found = []
    for path, pid, st in _pid_files(directories, paths.SOCKET_SUFFIX):
        if not stat.S_ISSOCK(st.st_mode) or str(path) in listening:
            continue
        if not procfs.is_alive(pid):
            found.append(StaleSocket(str(path), pid, "its process is gone"))
            continue
        started = process_start_time(pid)
        if started is not None and st.st_mtime < started - START_SLACK_S:
            found.append(StaleSocket(str(path), pid, "pid reused: the process started after the socket"))
    return found


# A restored copy's socket younger than this is left alone: CRIU may have made the file a
# moment before the copy listens on it again.
COPY_SOCKET_GRACE_S = 30.0


def _listening_anywhere() -> set[str]:
    """Listening socket paths in every network namespace of the host: a replica restored into
    a namespace of its own listens where this process's /proc/net/unix does not show it."""
    found = set(paths.listening_unix_paths())
    seen: set[str] = set()
    try:
        pids = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns in seen:
            continue
        seen.add(ns)
        found.update(paths.listening_unix_paths(f"/proc/{pid}/net/unix"))
    return found


def stale_copy_sockets(directories: Optional[list[Path]] = None) -> list[StaleSocket]:
    """Sockets of restored copies (``PID-TAG.sock``, see paths.COPY_SOCKET_NAME) that nothing
    listens on in any network namespace: the copy is gone (killed replicas leave them)."""
    listening: Optional[set[str]] = None
    found = []
    now = time.time()
    for directory in directories if directories is not None else _socket_dirs():
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not paths.COPY_SOCKET_NAME.fullmatch(name):
                continue
            path = directory / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode) or now - st.st_mtime < COPY_SOCKET_GRACE_S:
                continue
            if listening is None:
                listening = _listening_anywhere()
            if str(path) not in listening:
                found.append(
                    StaleSocket(str(path), int(name.split("-", 1)[0]), "no restored copy listens on it")
                )
    return found


def stale_lock_tokens(directories: Optional[list[Path]] = None) -> list[StaleSocket]:
    """Lock-token files (``PID.lock-token``, left for `npusnap thaw`) whose process is gone: no
    lock of theirs can still be held. A process that started after its token is not enough: a
    frozen process restored by CRIU keeps its pid and its lock but has a new start time."""
    return [
        StaleSocket(str(path), pid, "its process is gone")
        # PID.lock-taken, a `thaw --force`'s note for the command it took PID's lock from, goes
        # with its process too.
        for suffix in (paths.LOCK_TOKEN_SUFFIX, paths.LOCK_TAKEN_SUFFIX)
        for path, pid, st in _pid_files(directories, suffix)
        if stat.S_ISREG(st.st_mode) and not procfs.is_alive(pid)
    ]


def remove_stale_agent_sockets(directories: Optional[list[Path]] = None) -> list[StaleSocket]:
    """Remove stale agent sockets and lock tokens (a socket is checked again just before its
    unlink); return those removed."""
    removed = []
    for entry in stale_lock_tokens(directories):
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(entry)
    for entry in stale_agent_sockets(directories):
        path = Path(entry.path)
        with contextlib.suppress(OSError):
            if str(path) in set(paths.listening_unix_paths()):
                continue  # an agent bound it in the meantime
            path.unlink()
            removed.append(entry)
    for entry in stale_copy_sockets(directories):
        path = Path(entry.path)
        with contextlib.suppress(OSError):
            if str(path) in _listening_anywhere():
                continue  # a copy bound it in the meantime
            path.unlink()
            removed.append(entry)
    return removed


# --------------------------------------------------------------------------------------------
# Demo directories and the report for `npusnap check`
# --------------------------------------------------------------------------------------------


def demo_dirs() -> list[Path]:
    base = Path(tempfile.gettempdir())
    try:
        return sorted(p for p in base.iterdir() if p.name.startswith(DEMO_PREFIX) and p.is_dir())
    except OSError:
        return []


@dataclass(frozen=True)
class Debris:
    stale_sockets: list[StaleSocket] = field(default_factory=list)
    stale_tokens: list[StaleSocket] = field(default_factory=list)
    failure_logs: list[str] = field(default_factory=list)
    demo_dirs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stale_sockets": [s.to_dict() for s in self.stale_sockets],
            "stale_lock_tokens": [s.to_dict() for s in self.stale_tokens],
            "failure_logs": self.failure_logs,
            "log_dir": str(log_base()),
            "demo_dirs": self.demo_dirs,
        }


def debris_report() -> Debris:
    return Debris(
        stale_sockets=stale_agent_sockets() + stale_copy_sockets(),
        stale_tokens=stale_lock_tokens(),
        failure_logs=[str(p) for p in failure_logs()],
        demo_dirs=[str(p) for p in demo_dirs()],
    )
