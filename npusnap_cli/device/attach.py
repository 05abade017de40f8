"""Inject the npusnap agent into an already-running Python process (`npusnap attach PID`).

Two methods, chosen by the target's Python version:

* **3.14+**: ``sys.remote_exec(pid, bootstrap.py)`` (PEP 768). It needs the caller to run the
  same major.minor as the target, so when npusnap's own Python differs we run the *target's*
  interpreter (``/proc/PID/exe -I -c ...``). The script runs on the target's main thread at
  its next bytecode boundary, which the interpreter guarantees is safe.
* **3.9-3.13**: gdb makes one thread of the target ``dlopen()`` a tiny payload
  (``native/attach/payload.c``) whose constructor only starts a new thread; that thread takes
  the GIL properly and runs the bootstrap. gdb calls dlopen only on a thread at a safe point.
  First, reading no symbols at all (``native_attach.dlopen_in``, as for a native program): a
  thread blocked in a lock-free system call, looked for during FAST_WINDOW_S; gdb reading the
  symbols of a large job's hundreds of libraries is what stops it for seconds. Otherwise at a
  breakpoint on the entry of a libpython function reached from clean points, or on a thread
  blocked in a system call whose stack holds no allocator/loader frame; that driver
  (``native/attach/gdb_inject.py``) explains why, and reads only the symbols it needs. Neither
  runs Python code on a borrowed thread; both always detach.

How long the job could not run because of the attach is measured (``stopped_s``, an upper
bound): how long gdb had it traced, watched from outside, plus the time the bootstrap held the GIL.

Either way the bootstrap writes a status file, and attach succeeds only once the agent answers
``hello`` over its control socket with the target's pid. Before acting we probe (memray-style):
the pid exists, is a Python we support, is not stopped or already traced, we may trace it, and
whether an agent is already there (then attach is a no-op success). When anything fails the
error says what the target is doing (each thread's top frames, /proc state and wchan) and what
to do.

The per-attach files (bootstrap, status, payload copy) live in a fresh 0700 directory, files
0600 (the payload copy 0700, it is mapped executable), owned by the target's user, and are
deleted afterwards. The payload stays mapped in the target (a deleted file mapping, 16 KiB),
which CRIU saves as a ghost file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.agent import native
from npusnap_cli.device import native_attach
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import AgentError, PreflightError, TargetError
from npusnap_cli.host import procfs

DEFAULT_TIMEOUT = 10.0
MIN_PYTHON = (3, 9)
REMOTE_EXEC_PYTHON = (3, 14)
STATUS_NAME = "status.json"
BOOTSTRAP_NAME = "bootstrap.py"
PAYLOAD_NAME = "libnpusnap_attach.so"
GDB_SCRIPT_NAME = "gdb_inject.py"
# How long one breakpoint round waits before the driver looks for a thread blocked in a syscall.
BREAK_WAIT_S = 0.25
# gdb needs this much beyond the driver's own budget to start, read symbols and detach.
GDB_STARTUP_S = 15.0
# How long to look for a thread asleep in a lock-free system call (the symbol-free way in,
# native_attach.dlopen_in) before falling back to breakpoints, which need gdb to read symbols.
FAST_WINDOW_S = 1.0

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


@dataclass(frozen=True)
class InjectResult:
    """The bootstrap ran inside the target and reported ``status``."""

    pid: int
    method: str  # "gdb" or "remote_exec"
    safe_point: Optional[str]  # gdb: "breakpoint:<function>" or "syscall:<name>"
    tid: Optional[int]  # gdb: the thread that called dlopen
    status: dict[str, Any]
    elapsed_s: float
    # How long the target was stopped by ptrace (native_attach.TraceWatch: an upper bound); None
    # for sys.remote_exec, which does not stop it.
    ptrace_stopped_s: Optional[float] = None

    @property
    def stopped_s(self) -> float:
        """The longest the job could not run because of the attach (an upper bound): stopped by
        ptrace, then its Python threads waiting while the bootstrap held the GIL."""
        return round((self.ptrace_stopped_s or 0.0) + float(self.status.get("gil_s") or 0.0), 3)


@dataclass(frozen=True)
class AttachResult:
    pid: int
    method: str  # "already-present", "gdb" or "remote_exec"
    python: str
    socket: Optional[str]
    elapsed_s: float
    safe_point: Optional[str] = None
    tid: Optional[int] = None
    hello: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # things the operator should know (reported by the bootstrap)
    # How long the job could not run because of the attach (an upper bound; None: nothing was
    # injected): traced by gdb (native_attach.TraceWatch) plus, in a Python target, the time the
    # bootstrap held the GIL. ``stop`` has the parts.
    stopped_s: Optional[float] = None
    stop: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "method": self.method,
            "python": self.python,
            "stopped_s": self.stopped_s,
            "stop": self.stop,
            "socket": self.socket,
            "elapsed_s": round(self.elapsed_s, 3),
            "safe_point": self.safe_point,
            "tid": self.tid,
            "hello": self.hello,
            "notes": list(self.notes),
        }


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


# -- the per-attach directory and the bootstrap ---------------------------------------------------
@dataclass(frozen=True)
class _Workdir:
    host: Path  # where we write it
    target: str  # the same directory as the target sees it


@contextmanager
def _workdir(target: PythonTarget) -> Iterator[_Workdir]:
    """A fresh 0700 directory in the target's /tmp, owned by the target's user; removed afterwards."""
    base = "/tmp" if target.root == "/" else f"{target.root}/tmp"
    host = Path(tempfile.mkdtemp(prefix="npusnap-attach-", dir=base))
    try:
        if os.geteuid() == 0 and (target.uid, target.gid) != (0, 0):
            os.chown(host, target.uid, target.gid)
        target_path = str(host) if target.root == "/" else "/tmp/" + host.name
        yield _Workdir(host=host, target=target_path)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _write_private(path: Path, data: bytes, mode: int, target: PythonTarget) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        if os.geteuid() == 0 and (target.uid, target.gid) != (0, 0):
            os.fchown(fd, target.uid, target.gid)
    finally:
        os.close(fd)


_BOOTSTRAP_FRAME = """\
import _thread, json, os, sys, time, traceback
_T0 = time.monotonic()
_DIR = {dir!r}
def _report(data):
    data.update(pid=os.getpid(), python="%d.%d.%d" % sys.version_info[:3],
                native_tid=_thread.get_native_id(), gil_s=round(time.monotonic() - _T0, 4))
    tmp = os.path.join(_DIR, ".status.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(_DIR, {status!r}))
def _guess_main(me):
    found = []
    for ident, frame in sys._current_frames().items():
        while ident != me and frame.f_back is not None:
            frame = frame.f_back
        name = frame.f_globals.get("__name__")
        if ident != me and ((frame.f_code.co_name == "<module>" and name == "__main__")
                            or (name == "runpy" and frame.f_code.co_name == "_run_module_as_main")):
            found.append(ident)
    return found[0] if len(found) == 1 else 0
def _import_threading():
    # Before 3.13 `threading` takes whichever thread imports it first for the main thread. If the
    # application never imported it, that would be us: point it at the real main thread, with a
    # lock that stays held while the process lives (threading._shutdown releases it at exit).
    if "threading" in sys.modules or sys.version_info >= (3, 13):
        return None
    me = _thread.get_ident()
    main = __npusnap_main_ident__ or _guess_main(me)
    import threading
    mt = threading._main_thread
    if mt.ident != me:
        return None
    if not main:
        return "threading was first imported by the attach thread and the main thread is unknown"
    lock = _thread.allocate_lock()
    lock.acquire()
    with threading._active_limbo_lock:
        threading._active.pop(me, None)
        mt._ident = main
        mt._native_id = os.getpid()
        mt._tstate_lock = lock
        threading._active[main] = mt
    return None
try:
    _threading_note = _import_threading()
{body}
except BaseException as _exc:
    _report({{"ok": False, "stage": "bootstrap", "error": "%s: %s" % (type(_exc).__name__, _exc),
              "traceback": traceback.format_exc()}})
"""

# Starts the agent from npusnap's own package directory: put it on sys.path only for the import
# (the package keeps its __path__ for later submodule imports), so that the application's own
# imports never see our directory.
AGENT_BODY = """\
_parent = {parent!r}
_added = "npusnap_cli" not in sys.modules and _parent not in sys.path
if _added:
    sys.path.insert(0, _parent)
try:
    import npusnap_cli.agent as _agent
finally:
    if _added and _parent in sys.path:
        sys.path.remove(_parent)
_sock = _agent.start()
if _sock is None:
    raise RuntimeError("npusnap_cli.agent.start() failed; the agent log (<runtime dir>/<pid>.log) says why")
_report({{"ok": True, "socket": _sock, "agent_module": _agent.__file__, "note": _threading_note}})
"""


def bootstrap_source(body: str, target_dir: str) -> str:
    """The bootstrap file: one exec() statement, so that it leaves no names in any namespace.

    ``body`` runs inside ``try:`` with ``_report(dict)`` available and must call it on success.
    """
    inner = _BOOTSTRAP_FRAME.format(
        dir=target_dir, status=STATUS_NAME, body="\n".join("    " + ln for ln in body.splitlines())
    )
    # The gdb payload passes __npusnap_main_ident__; sys.remote_exec (3.14+) does not need it.
    return (
        f"exec(compile({inner!r}, {target_dir + '/' + BOOTSTRAP_NAME!r}, 'exec'), "
        "{'__npusnap_main_ident__': globals().get('__npusnap_main_ident__', 0)})\n"
    )


# -- injection -------------------------------------------------------------------------------------
def find_gdb() -> Optional[str]:
    return shutil.which("gdb")


def inject(target: PythonTarget, body: str, timeout: float = DEFAULT_TIMEOUT) -> InjectResult:
    """Run ``body`` (see ``bootstrap_source``) once inside the target; return what it reported."""
    start = time.monotonic()
    deadline = start + timeout
    with _workdir(target) as wd:
        src = bootstrap_source(body, wd.target)
        _write_private(wd.host / BOOTSTRAP_NAME, src.encode(), 0o600, target)
        safe_point: Optional[str] = None
        tid: Optional[int] = None
        gdb_report: dict[str, Any] = {}
        stopped: Optional[float] = None
        if target.method == "remote_exec":
            _remote_exec(target, f"{wd.target}/{BOOTSTRAP_NAME}", deadline)
        else:
            _place_payload(target, wd)
            fast = _fast_inject(target, wd, deadline)
            if fast is not None:
                safe_point, tid, stopped = fast["safe_point"], fast["tid"], fast["stopped_s"]
            else:
                gdb_report = _gdb_inject(target, wd, deadline)
                stopped = gdb_report["stopped_s"]
                safe_point = gdb_report.get("method")
                tid = gdb_report.get("tid")
        status = _wait_status(target, wd, deadline, gdb_report)
    return InjectResult(
        pid=target.pid,
        method=target.method,
        safe_point=safe_point,
        tid=tid,
        status=status,
        elapsed_s=time.monotonic() - start,
        ptrace_stopped_s=stopped,
    )


def _place_payload(target: PythonTarget, wd: _Workdir) -> None:
    payload = paths.attach_payload_path()
    if not payload.is_file() or not (payload.parent / GDB_SCRIPT_NAME).is_file():
        raise PreflightError(
            f"the attach payload is not built ({payload})",
            why="native code is built by the setup script",
            fix="run ./scripts/setup.sh (or `make -C native`)",
        )
    if find_gdb() is None:
        raise PreflightError(
            f"gdb is needed to attach to Python {target.version_str} but is not installed",
            why="before Python 3.14 there is no safe built-in way to run code in another process",
            fix="apt-get install gdb (or dnf install gdb), or start the job with `npusnap run -- <command>`",
        )
    # A fresh copy per attach: dlopen() of an already-loaded path would not run the constructor.
    _write_private(wd.host / PAYLOAD_NAME, payload.read_bytes(), 0o700, target)


def _fast_inject(target: PythonTarget, wd: _Workdir, deadline: float) -> Optional[dict[str, Any]]:
    """The payload dlopened on a thread asleep in a lock-free system call, gdb reading no symbols
    (native_attach.dlopen_in): a large job (hundreds of libraries) is stopped a fraction of a
    second instead of the seconds gdb takes to read their symbols. None when it does not apply
    (not x86-64, a container's filesystem, no such thread within FAST_WINDOW_S): the caller then
    uses the breakpoint method, which reads symbols."""
    import platform

    if platform.machine() != "x86_64" or target.root != "/":
        return None
    if os.environ.get("NPUSNAP_TEST_ATTACH_WAY") == "breakpoint":  # tests only: the other way in
        return None
    give_up = time.monotonic() + min(FAST_WINDOW_S, max(0.0, deadline - time.monotonic()) / 2)
    return native_attach.dlopen_in(target.pid, f"{wd.target}/{PAYLOAD_NAME}", deadline, give_up)


def _wait_status(
    target: PythonTarget, wd: _Workdir, deadline: float, gdb_report: dict[str, Any]
) -> dict[str, Any]:
    path = wd.host / STATUS_NAME
    while True:
        if path.exists():
            try:
                status: dict[str, Any] = json.loads(path.read_text())
            except (OSError, ValueError):
                status = {}
            if status:
                if not status.get("ok"):
                    raise AgentError(
                        f"the bootstrap ran in pid {target.pid} but failed: {status.get('error', '?')}",
                        why="starting the agent inside the target raised (details has its traceback)",
                        fix="see the traceback; the target keeps running unchanged",
                        details={"pid": target.pid, "status": status, "gdb": _short_report(gdb_report)},
                    )
                return status
        if time.monotonic() >= deadline or not os.path.exists(f"/proc/{target.pid}"):
            break
        time.sleep(0.02)
    if not os.path.exists(f"/proc/{target.pid}"):
        raise TargetError(f"pid {target.pid} exited during attach", why="it ended, or crashed")
    why = (
        "the main thread did not run Python bytecode in time (sys.remote_exec runs there only)"
        if target.method == "remote_exec"
        else "the payload was loaded but its thread could not take the GIL in time "
        "(a thread holds it in a long C call)"
    )
    raise AgentError(
        f"the bootstrap did not report from pid {target.pid} in time",
        why=why + "; the bootstrap files are removed now, so it will not start later",
        fix=f"retry with a longer `--timeout`, or start the job with `npusnap run`; "
        f"see where each thread is with `gdb -p {target.pid} -batch -ex 'thread apply all bt'`",
        details=diagnose(target.pid, gdb_report),
    )


def _remote_exec(target: PythonTarget, script: str, deadline: float) -> None:
    """PEP 768 with the target's own interpreter when ours is a different major.minor."""
    same = sys.version_info[:2] == target.version
    exe = sys.executable if same else f"/proc/{target.pid}/exe"
    code = f"import sys; sys.remote_exec({target.pid}, {script!r})"
    try:
        proc = subprocess.run(
            [exe, "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=max(5.0, deadline - time.monotonic()),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise AgentError(
            f"sys.remote_exec into pid {target.pid} did not return",
            fix="retry; `npusnap run` avoids attaching",
            details=diagnose(target.pid),
        ) from None
    except OSError as exc:
        raise PreflightError(f"cannot run {exe} for sys.remote_exec: {exc}") from None
    if proc.returncode == 0:
        return
    err = proc.stderr.strip()
    last = err.splitlines()[-1] if err else f"exit status {proc.returncode}"
    details = {"pid": target.pid, "interpreter": exe, "stderr": err[-2000:]}
    if "not enabled" in err or "disable" in err.lower():
        raise TargetError(
            f"remote debugging is disabled in pid {target.pid}",
            why="the target was started with PYTHON_DISABLE_REMOTE_DEBUG set (any value) or "
            "`-X disable-remote-debug`, or its Python was built --without-remote-debug",
            fix="restart the job without that setting, or start it with `npusnap run -- <command>`",
            details=details,
        )
    if "ermission" in err or "not permitted" in err:
        raise TargetError(
            f"not allowed to attach to pid {target.pid}: {last}",
            why=f"sys.remote_exec needs ptrace rights (same user or CAP_SYS_PTRACE; Yama ptrace_scope "
            f"= {ptrace_scope()})",
            fix=f"run `sudo npusnap attach {target.pid}`",
            details=details,
        )
    if "version" in err.lower() or "mismatch" in err.lower():
        raise TargetError(
            f"sys.remote_exec refused pid {target.pid}: {last}",
            why="the caller's Python must be the same major.minor (and build flavour) as the target's",
            fix=f"make sure {exe} is the target's interpreter, or start the job with `npusnap run`",
            details=details,
        )
    raise AgentError(f"sys.remote_exec into pid {target.pid} failed: {last}", details=details)


def _gdb_inject(target: PythonTarget, wd: _Workdir, deadline: float) -> dict[str, Any]:
    gdb = find_gdb()
    assert gdb is not None  # _place_payload checked
    script = paths.attach_payload_path().parent / GDB_SCRIPT_NAME
    report_path = wd.host / "gdb-report.json"
    budget = max(1.0, deadline - time.monotonic() - 1.0)
    env = dict(os.environ)
    env.update(
        NPUSNAP_ATTACH_PAYLOAD=f"{wd.target}/{PAYLOAD_NAME}",
        NPUSNAP_ATTACH_REPORT=str(report_path),
        NPUSNAP_ATTACH_BUDGET=f"{budget:.2f}",
        NPUSNAP_ATTACH_BREAK_WAIT=str(BREAK_WAIT_S),
        LC_ALL="C",
    )
    cmd = [gdb, "--batch", "-nx", "-q"]
    for setting in (
        "set auto-load off",
        "set auto-solib-add off",  # gdb_inject.py reads the symbols it needs, not all (seconds)
        "set debuginfod enabled off",
        "set non-stop on",
        "set pagination off",
        "set confirm off",
    ):
        cmd += ["-iex", setting]
    cmd += ["-p", str(target.pid), "-x", str(script)]

    t0 = time.monotonic()
    watch = native_attach.TraceWatch(target.pid)
    try:
        with watch:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
            )
            out, _ = proc.communicate(timeout=budget + GDB_STARTUP_S)
    except subprocess.TimeoutExpired:
        out = _stop_gdb(proc)
        raise AgentError(
            f"gdb did not finish attaching to pid {target.pid} and was stopped",
            why="gdb hung (symbol loading, or the target does not respond to ptrace)",
            fix=f"check that pid {target.pid} still runs normally (`npusnap status {target.pid}`); "
            "prefer `npusnap run` for this job",
            details=dict(diagnose(target.pid), gdb_output=out[-3000:], target_state=_proc_state(target.pid)),
        ) from None
    try:
        report: dict[str, Any] = json.loads(report_path.read_text())
    except (OSError, ValueError):
        raise _gdb_failed(target, out) from None
    report["stopped_s"] = watch.stopped_s(time.monotonic() - t0)
    if not report.get("detached", False):
        raise AgentError(
            f"gdb could not detach cleanly from pid {target.pid}: {report.get('detach_error')}",
            why="gdb reported an error while detaching",
            fix=f"check pid {target.pid} (`npusnap status {target.pid}`, /proc/{target.pid}/status)",
            details=dict(diagnose(target.pid, report), gdb_output=out[-3000:]),
        )
    if not report.get("ok"):
        raise AgentError(
            f"could not load the agent payload into pid {target.pid}: {report.get('detail')}",
            why="no thread reached a point where it is safe to borrow it (busy in C code without "
            "system calls, or holding the allocator), or dlopen failed; the target was left running",
            fix=f"retry (`npusnap attach {target.pid} --timeout 30`), or start the job with `npusnap run`",
            details=diagnose(target.pid, report),
        )
    return report


def _stop_gdb(proc: subprocess.Popen[str]) -> str:
    # SIGTERM first: gdb then detaches (removing its breakpoints); SIGKILL would leave them in.
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def _gdb_failed(target: PythonTarget, out: str) -> Exception:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    ptrace = next((ln for ln in lines if "ptrace" in ln.lower() or "not permitted" in ln), None)
    details = dict(diagnose(target.pid), gdb_output="\n".join(lines[-30:]))
    if ptrace:
        return TargetError(
            f"gdb could not attach to pid {target.pid}: {ptrace.strip()}",
            why="ptrace was refused: another tracer, Yama (ptrace_scope "
            f"{ptrace_scope()}), a container without CAP_SYS_PTRACE, or a non-dumpable process",
            fix=f"run `sudo npusnap attach {target.pid}`; in a container add --cap-add=SYS_PTRACE",
            details=details,
        )
    return AgentError(
        f"gdb failed while attaching to pid {target.pid}",
        why=lines[-1] if lines else "gdb printed nothing",
        fix="rerun with -v; check that gdb works: `gdb -p PID -batch -ex bt`",
        details=details,
    )


def _short_report(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report.get(k) for k in ("ok", "method", "tid", "detail", "rounds", "elapsed_s") if k in report}


def diagnose(pid: int, gdb_report: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What the target is doing: process state, wchan, and each thread's top frames if gdb saw them."""
    scope = ptrace_scope()
    info: dict[str, Any] = {
        "pid": pid,
        "alive": os.path.exists(f"/proc/{pid}"),
        "state": _proc_state(pid),
        "wchan": (_read(f"/proc/{pid}/wchan") or "").strip() or None,
        "ptrace_scope": scope if scope is not None else "no Yama",
        "gdb": find_gdb(),
        "tracer_pid": int(_status_fields(pid).get("TracerPid", "0") or 0),
    }
    threads = []
    gdb_threads = {t.get("tid"): t for t in (gdb_report or {}).get("threads", [])}
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        tids = []
    for tid in tids[:64]:
        entry: dict[str, Any] = {
            "tid": tid,
            "name": (_read(f"/proc/{pid}/task/{tid}/comm") or "").strip(),
            "state": _proc_state_task(pid, tid),
            "wchan": (_read(f"/proc/{pid}/task/{tid}/wchan") or "").strip() or None,
        }
        seen = gdb_threads.get(tid)
        if seen:
            entry["syscall"] = seen.get("syscall")
            entry["frames"] = [
                f"{f.get('name')} ({f.get('lib')})" if f.get("lib") else str(f.get("name"))
                for f in (seen.get("frames") or [])[:6]
            ]
        threads.append(entry)
    info["threads"] = threads
    if gdb_report:
        info["gdb_report"] = _short_report(gdb_report)
    return info


def _proc_state_task(pid: int, tid: int) -> str:
    st = procfs.stat(pid, tid)
    return st.state if st else ""


# -- attach ----------------------------------------------------------------------------------------
def _hello(pid: int, timeout: float, retry_s: float) -> dict[str, Any]:
    with AgentClient(pid, timeout=timeout, connect_retry_s=retry_s) as client:
        return client.hello()


def existing_agent(pid: int) -> Optional[dict[str, Any]]:
    """The hello answer of an agent already serving ``pid``, or None."""
    if paths.find_agent_socket(pid) is None:
        return None
    try:
        return _hello(pid, timeout=3.0, retry_s=0.0)
    except (AgentError, TargetError):
        return None


def attach_native(pid: int, timeout: float = DEFAULT_TIMEOUT) -> AttachResult:
    """A non-Python process with the CANN runtime loaded: gdb dlopens the native agent into it
    (see native_attach.py); succeeds once the agent answers hello."""
    start = time.monotonic()
    status = _status_fields(pid)
    state = _proc_state(pid)
    tracer = int(status.get("TracerPid", "0") or 0)
    if tracer:
        raise TargetError(
            f"pid {pid} is already being traced by pid {tracer} ({_comm(tracer)})",
            why="a process can have only one tracer",
            fix=f"detach it from the target, then rerun `npusnap attach {pid}`",
        )
    if state in ("T", "t", "Z", "X"):
        raise TargetError(f"pid {pid} is stopped or exited (state {state})", fix=f"`kill -CONT {pid}` first")
    uid = os.stat(f"/proc/{pid}").st_uid
    gid = os.stat(f"/proc/{pid}").st_gid
    _check_permissions(pid, uid)
    hello = existing_agent(pid)
    if hello is not None:
        return AttachResult(
            pid=pid,
            method="already-present",
            python="none",
            socket=hello.get("socket"),
            elapsed_s=time.monotonic() - start,
            hello=hello,
        )
    library = native.library_path(include_mapped=False)
    if library is None:
        raise PreflightError(
            f"the native agent library {native.LIBRARY_NAME} is not built",
            why="looked at " + ", ".join(str(p) for p in native.candidates()),
            fix="run scripts/setup.sh (or `make -C native`)",
        )
    done = native_attach.inject(pid, uid, gid, library, timeout)
    remaining = max(2.0, timeout - (time.monotonic() - start))
    try:
        hello = _hello(pid, timeout=remaining, retry_s=remaining)
    except (AgentError, TargetError) as exc:
        raise AgentError(
            f"the agent library was loaded into pid {pid} but does not answer hello: {exc}",
            why="the agent could not start (its reason is in its log: <runtime dir>/<pid>.log)",
            fix=f"`npusnap status {pid}`; or start the program with `npusnap run -- CMD`",
        ) from None
    return AttachResult(
        pid=pid,
        method="gdb-native",
        python="none",
        socket=hello.get("socket"),
        elapsed_s=time.monotonic() - start,
        safe_point=done["safe_point"],
        tid=done["tid"],
        hello=hello,
        stopped_s=done["stopped_s"],
        stop={"ptrace_s": done["stopped_s"], "gil_s": None},
    )


def attach(pid: int, timeout: float = DEFAULT_TIMEOUT) -> AttachResult:
    """Make sure ``pid`` runs an npusnap agent that answers hello; inject one if needed."""
    if os.path.exists(f"/proc/{pid}") and native_attach.is_native_npu_process(pid):
        return attach_native(pid, timeout)
    start = time.monotonic()
    target = probe(pid)
    hello = existing_agent(pid)
    if hello is not None:
        return AttachResult(
            pid=pid,
            method="already-present",
            python=target.version_str,
            socket=hello.get("socket"),
            elapsed_s=time.monotonic() - start,
            hello=hello,
        )
    body = AGENT_BODY.format(parent=str(paths.PACKAGE_DIR.parent))
    result = inject(target, body, timeout=timeout)
    remaining = max(2.0, timeout - (time.monotonic() - start))
    try:
        hello = _hello(pid, timeout=remaining, retry_s=remaining)
    except (AgentError, TargetError) as exc:
        raise AgentError(
            f"the agent started in pid {pid} but does not answer hello: {exc}",
            why=getattr(exc, "why", "") or "the agent thread is not serving its socket",
            fix=f"read the agent log ({paths.agent_log_path(pid)}); `npusnap status {pid}`",
            details=dict(diagnose(pid), status=result.status),
        ) from None
    if hello.get("pid") != pid:
        raise AgentError(
            f"the agent socket of pid {pid} answered for pid {hello.get('pid')}",
            why="another process serves the socket name",
            details={"pid": pid, "hello": hello},
        )
    return AttachResult(
        pid=pid,
        method=result.method,
        python=target.version_str,
        socket=hello.get("socket") or result.status.get("socket"),
        elapsed_s=time.monotonic() - start,
        safe_point=result.safe_point,
        tid=result.tid,
        hello=hello,
        notes=tuple(str(n) for n in [result.status.get("note")] if n),
        stopped_s=result.stopped_s,
        stop={"ptrace_s": result.ptrace_stopped_s, "gil_s": result.status.get("gil_s")},
    )
