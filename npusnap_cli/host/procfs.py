"""One process's entries under /proc: its stat line, alive, session, command line.

Standard library only and cheap to import: the simulator's manager, the CLI's pipelines, the
tests and the benchmark all ask these questions, often of a pid they remembered. pids are reused
(pid_max may be as low as 32768), so whoever kills a remembered pid checks its command line first.
``/proc/PID/stat`` is parsed here and nowhere else (``stopguard_watch`` loads this module too).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/PID/stat`` that npusnap reads (proc(5) numbers them from 1)."""

    pid: int  # field 1 (the thread id when read from /proc/PID/task/TID/stat)
    comm: str  # field 2, without its parentheses
    state: str  # field 3: R, S, D, T (stopped), t (traced), Z (zombie), X (dead), ...
    ppid: int  # field 4
    pgrp: int  # field 5
    session: int  # field 6: 0 when the session leader is outside this pid namespace
    start_time: int  # field 22: clock ticks after boot; a CRIU restore gives a new value


def parse_stat(data: bytes) -> Stat:
    """Parse one stat line; ValueError when it is not one.

    comm may hold spaces and parentheses, so the fields after it are split after the last ')'.
    """
    head, close, tail = data.rpartition(b")")
    pid, open_, comm = head.partition(b" (")
    rest = tail.split()
    if not close or not open_ or len(rest) < 20:
        raise ValueError(f"not a /proc/PID/stat line: {data[:80]!r}")
    return Stat(
        pid=int(pid),
        comm=comm.decode("utf-8", "replace"),
        state=rest[0].decode("ascii", "replace"),
        ppid=int(rest[1]),
        pgrp=int(rest[2]),
        session=int(rest[3]),
        start_time=int(rest[19]),
    )


def read_stat(pid: Union[int, str], tid: Union[int, str, None] = None) -> Stat:
    """The stat line of ``pid`` (or of its thread ``tid``). FileNotFoundError or
    ProcessLookupError once it is gone, another OSError or ValueError when it cannot be read."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path, "rb") as f:
        return parse_stat(f.read())


def stat(pid: Union[int, str], tid: Union[int, str, None] = None) -> Optional[Stat]:
    """:func:`read_stat`, or None when ``pid`` is gone or its stat cannot be read."""
    try:
        return read_stat(pid, tid)
    except (OSError, ValueError):
        return None


def state(pid: int, tid: Optional[int] = None) -> Optional[str]:
    """The state letter of a pid or thread id ("Z" a zombie, "X" dead), None once it is gone,
    "?" when it is there but unreadable."""
    try:
        return read_stat(pid, tid).state
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError):
        return "?"


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a dead child not yet reaped still holds its pid)."""
    return state(pid) not in (None, "?", "Z", "X")


def ns_pids(pid: int) -> list[int]:
    """``NSpid`` of ``pid``: its pid in each pid namespace it is in, outermost (ours) first."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def stop_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, tracer pid) if ``pid`` is stopped or traced ('T'/'t'), else None."""
    st = state(pid)
    if st not in ("T", "t"):
        return None
    try:
        tracer = 0
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return (st, tracer)


def session_id(pid: int) -> Optional[int]:
    """The session id of ``pid`` as this pid namespace sees it (None when it is gone).

    0 means the session leader lives outside this pid namespace: the job was started by
    something outside the container (``docker exec``, ``nsenter``, a CI runner).
    """
    st = stat(pid)
    return st.session if st else None


def cmdline(pid: int) -> str:
    """The command line of ``pid``, space-separated ("" when it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_time(pid: Union[int, str] = "self") -> Optional[int]:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None when it cannot be read."""
    st = stat(pid)
    return st.start_time if st else None


def age(pid: Union[int, str] = "self") -> Optional[float]:
    """Seconds since ``pid`` started, to a clock tick: its start (ticks after boot) against
    /proc/uptime, both counted from boot (the boot time in /proc/stat is whole seconds)."""
    ticks = start_time(pid)
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - (ticks or 0) / os.sysconf("SC_CLK_TCK")) if ticks is not None else None
    except (OSError, ValueError, IndexError):
        return None


# kcmp(2): whether two processes share a kernel object. The generic syscall table (aarch64) and
# x86_64 number it differently.
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}
_KCMP_FILES = 2


def shares_fd_table(pid: int, other: int) -> Optional[bool]:
    """Whether ``pid`` and ``other`` share one descriptor table (clone with CLONE_FILES, or
    threads); None when the kernel will not say (no kcmp, no ptrace access to either)."""
    nr = _SYS_KCMP.get(os.uname().machine)
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(nr, pid, other, _KCMP_FILES, 0, 0)
    return None if rc < 0 else rc == 0


def threads_in_other_cgroups(pid: int) -> list[int]:
    """The threads of ``pid`` whose cgroups (/proc/PID/task/TID/cgroup) are not its main
    thread's: cgroup v1 moves one thread at a time (``tasks``). Empty if none, or if unreadable."""
    try:
        main = Path(f"/proc/{pid}/task/{pid}/cgroup").read_text()
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []
    other = []
    for tid in sorted(tids):
        try:
            if Path(f"/proc/{pid}/task/{tid}/cgroup").read_text() != main:
                other.append(tid)
        except OSError:
            continue
    return other


_SYS_PIDFD_GETFD = 438  # x86_64 and the generic syscall table (arm64) agree


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A duplicate, in this process and close-on-exec, of ``fd`` of the process ``pidfd`` refers
    to (pidfd_getfd(2)): the same open file, reached without opening it again."""
    libc = ctypes.CDLL(None, use_errno=True)
    got = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.set_inheritable(got, False)
    return got


def _readable(pid: int, fd: str) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as info:
            flags = next((int(ln.split()[1], 8) for ln in info if ln.startswith("flags:")), None)
    except (OSError, ValueError, IndexError):
        return False
    return flags is not None and flags & os.O_ACCMODE != os.O_WRONLY


def fd_of_file(pid: int, st: os.stat_result) -> Optional[int]:
    """A duplicate of an fd of ``pid`` open for reading that is the file ``st`` (device and
    inode), or None."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            fst = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not _readable(pid, name):
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            return pidfd_getfd(pidfd, int(name))
        except OSError:
            return None
        finally:
            os.close(pidfd)
    return None
