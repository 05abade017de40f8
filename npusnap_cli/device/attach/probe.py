"""The probe before any attach: the pid is a Python npusnap supports, not stopped or already
traced, and may be traced by this process; what /proc says of it."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from npusnap_cli.errors import TargetError
from npusnap_cli.host import procfs

MIN_PYTHON = (3, 9)
REMOTE_EXEC_PYTHON = (3, 14)

_LIBPYTHON_RE = re.compile(r"/libpython(\d+)\.(\d+)[a-z]*\.so")
_PYTHON_EXE_RE = re.compile(r"^python(\d+)\.(\d+)[a-z]*$")


@dataclass(frozen=True)
class PythonTarget:
    """What the probe found out about the target process."""

    pid: int
    version: tuple[int, int]
    exe: str
    libpython: Optional[str]  # None when the interpreter is linked into the executable
    uid: int
    gid: int
    state: str
    root: str  # how this process reaches the target's filesystem root ("/" or /proc/PID/root)

    @property
    def version_str(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    @property
    def method(self) -> str:
        return "remote_exec" if self.version >= REMOTE_EXEC_PYTHON else "gdb"


# -- /proc helpers -------------------------------------------------------------------------------
def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _status_fields(pid: int) -> dict[str, str]:
    text = _read(f"/proc/{pid}/status") or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


def _proc_state(pid: int) -> str:
    """The one-letter state from /proc/PID/stat (R, S, D, T, t, Z, ...), "" if unreadable."""
    st = procfs.stat(pid)
    return st.state if st else ""


def ptrace_scope() -> Optional[int]:
    """Yama's ptrace_scope (0-3), or None where Yama is not present."""
    text = _read("/proc/sys/kernel/yama/ptrace_scope")
    try:
        return int(text.strip()) if text else None
    except ValueError:
        return None


def _comm(pid: int) -> str:
    return (_read(f"/proc/{pid}/comm") or "?").strip()


def _is_ancestor(pid: int) -> bool:
    """Whether this process is an ancestor of ``pid`` (what Yama scope 1 allows without privilege)."""
    me = os.getpid()
    cur = pid
    for _ in range(256):
        ppid = _status_fields(cur).get("PPid")
        if not ppid or ppid == "0":
            return False
        cur = int(ppid)
        if cur == me:
            return True
    return False


# -- probe ---------------------------------------------------------------------------------------
def probe(pid: int) -> PythonTarget:
    """Check that ``pid`` is a running Python we can attach to; raise a clear error otherwise."""
    if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise TargetError(
            f"no process with pid {pid}",
            why="it exited, or it runs in another PID namespace",
            fix="check the pid with `ps -p PID` and rerun",
        )
    status = _status_fields(pid)
    state = _proc_state(pid)
    if state == "Z" or state == "X":
        raise TargetError(f"pid {pid} has exited (zombie)", why="nothing is running there any more")
    tracer = int(status.get("TracerPid", "0") or 0)
    if tracer and tracer != os.getpid():
        raise TargetError(
            f"pid {pid} is already being traced by pid {tracer} ({_comm(tracer)})",
            why="a process can have only one tracer (a debugger, strace, py-spy, another attach)",
            fix=f"detach {_comm(tracer)} (pid {tracer}) from the target, then rerun `npusnap attach {pid}`",
            details={"pid": pid, "tracer_pid": tracer},
        )
    if state in ("T", "t"):
        raise TargetError(
            f"pid {pid} is stopped (state {state})",
            why="it was stopped by a signal (SIGSTOP, Ctrl-Z) or a debugger; attaching would resume it "
            "behind your back, and a stopped process cannot start an agent",
            fix=f"resume it with `kill -CONT {pid}`, then rerun `npusnap attach {pid}`",
            details={"pid": pid, "state": state},
        )
    uids = status.get("Uid", "").split()
    gids = status.get("Gid", "").split()
    uid = int(uids[1]) if len(uids) > 1 else os.stat(f"/proc/{pid}").st_uid
    gid = int(gids[1]) if len(gids) > 1 else os.stat(f"/proc/{pid}").st_gid
    _check_permissions(pid, uid)
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except PermissionError:
        if os.geteuid() == 0:
            # Root refused: the process is not dumpable (prctl PR_SET_DUMPABLE 0, a set-uid or
            # specially protected process) or an LSM says no; sudo would not help.
            raise TargetError(
                f"permission denied reading /proc/{pid}/maps, even as root",
                why="the process is not dumpable (PR_SET_DUMPABLE 0, set-uid) or a security module "
                "(Yama, SELinux, AppArmor) forbids inspecting it",
                fix="start it with an agent instead: `npusnap run -- CMD` or `agent.start()` in its code",
            ) from None
        raise TargetError(
            f"permission denied reading /proc/{pid}",
            why=f"pid {pid} runs as uid {uid}; only that user or root may inspect and attach to it",
            fix=f"run `sudo npusnap attach {pid}` or run it as the user that owns the process",
        ) from None
    except OSError as exc:
        raise TargetError(f"cannot inspect pid {pid}: {exc}", why="it may have just exited") from None
    libpython = None
    version: Optional[tuple[int, int]] = None
    for line in maps.splitlines():
        m = _LIBPYTHON_RE.search(line)
        if m:
            libpython = line.split(None, 5)[-1].strip()
            version = (int(m.group(1)), int(m.group(2)))
            break
    exe_name = os.path.basename(exe.replace(" (deleted)", ""))
    if version is None:
        m = _PYTHON_EXE_RE.match(exe_name)
        if m:
            version = (int(m.group(1)), int(m.group(2)))
        elif exe_name.startswith("python"):
            version = _ask_interpreter_version(pid)
    if version is None:
        raise TargetError(
            f"pid {pid} ({_comm(pid)}) is not a Python process",
            why=f"its executable is {exe} and no libpython is mapped into it",
            fix="a native program without the CANN runtime loaded has nothing to snapshot; once it "
            "loads it, `npusnap attach` loads the native agent into it (or start it with `npusnap run`)",
            details={"pid": pid, "exe": exe},
        )
    if version < MIN_PYTHON:
        raise TargetError(
            f"pid {pid} runs Python {version[0]}.{version[1]}, older than npusnap supports (3.9)",
            why="the agent needs Python 3.9 or newer",
            fix="start the job on Python 3.9+ (and with `npusnap run`)",
            details={"pid": pid, "python": f"{version[0]}.{version[1]}"},
        )
    root = "/"
    try:
        if os.stat(f"/proc/{pid}/root") != os.stat("/"):
            root = f"/proc/{pid}/root"
    except OSError:
        pass
    return PythonTarget(
        pid=pid, version=version, exe=exe, libpython=libpython, uid=uid, gid=gid, state=state, root=root
    )


def _ask_interpreter_version(pid: int) -> Optional[tuple[int, int]]:
    """Version of a `python` executable without a version in its name (a static build)."""
    try:
        proc = subprocess.run(
            [f"/proc/{pid}/exe", "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"^(\d+)\.(\d+)$", proc.stdout.strip())
    return (int(m.group(1)), int(m.group(2))) if m and proc.returncode == 0 else None


def _check_permissions(pid: int, uid: int) -> None:
    euid = os.geteuid()
    if euid != 0 and euid != uid:
        raise TargetError(
            f"pid {pid} belongs to uid {uid}; you are uid {euid}",
            why="attaching needs ptrace rights over the target: the same user, or root",
            fix=f"run `sudo npusnap attach {pid}`",
        )
    scope = ptrace_scope()
    if scope == 3:
        raise TargetError(
            "ptrace is disabled on this host (kernel.yama.ptrace_scope = 3)",
            why="Yama scope 3 forbids attaching to any process, even as root, until reboot",
            fix="start the job with `npusnap run -- <command>` (or call npusnap_cli.agent.start() in it) "
            "so it needs no attach",
        )
    if scope == 2 and euid != 0:
        raise TargetError(
            "only root may attach to processes here (kernel.yama.ptrace_scope = 2)",
            why="Yama scope 2 requires CAP_SYS_PTRACE",
            fix=f"run `sudo npusnap attach {pid}`",
        )
    if scope == 1 and euid != 0 and not _is_ancestor(pid):
        raise TargetError(
            f"Yama refuses to let you attach to pid {pid} (kernel.yama.ptrace_scope = 1)",
            why="scope 1 only allows tracing your own descendants without CAP_SYS_PTRACE",
            fix=f"run `sudo npusnap attach {pid}`, or `sudo sysctl kernel.yama.ptrace_scope=0`",
        )
