"""Attach the native agent to a running non-Python process that has the CANN runtime loaded.

How, and why this way:

* The agent library is copied into a fresh 0700 directory next to a marker file; its
  constructor starts the agent when it finds the marker beside itself (the running process's
  environment cannot be changed, so ``NPUSNAP_AGENT=1`` cannot switch it on).
* gdb makes one thread call ``dlopen()`` of that copy. The thread is one blocked in a system
  call that holds no lock of the process (sleep, poll, read, accept, wait; never futex, which
  may be the allocator's lock), checked again after gdb stopped it: dlopen allocates memory and
  takes the loader lock, so a thread stopped inside malloc or the loader would deadlock.
* gdb reads no symbols (``auto-solib-add off``): the address of ``dlopen`` is computed here,
  before the target is stopped, from libc's dynamic symbol table and its load address in
  /proc/PID/maps. Reading symbols is what stops a large process (a JAX or PyTorch job maps
  hundreds of libraries) for seconds; without it the stop is a fraction of a second.
* The time the target was stopped is measured from outside (``TraceWatch``: while it is traced,
  an upper bound) and reported.
* ``dlopen_in`` is also the first way into a Python target (attach.py): a Python job that has a
  thread asleep in such a call gets the attach payload the same way, without symbols.

x86-64 only (the syscall numbers below); other machines get a clear refusal.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import acl, elf
from npusnap_cli.errors import AgentError, PreflightError, TargetError

MARKER_NAME = "npusnap-attach-start"
# x86-64 syscalls a thread can be blocked in without holding any lock of the process.
SAFE_SYSCALLS = {
    0: "read",
    7: "poll",
    23: "select",
    35: "nanosleep",
    43: "accept",
    45: "recvfrom",
    47: "recvmsg",
    61: "wait4",
    230: "clock_nanosleep",
    232: "epoll_wait",
    270: "pselect6",
    271: "ppoll",
    281: "epoll_pwait",
    288: "accept4",
}

GDB_SCRIPT = r"""
import gdb, struct, time
t0 = time.monotonic()
pid, tid, fn, lib = {pid}, {tid}, {addr}, {lib!r}
safe = {safe!r}
GP = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11",
      "r12", "r13", "r14", "r15", "rip", "eflags", "orig_rax")

def reg(name):
    return int(gdb.selected_frame().read_register(name)) & 0xFFFFFFFFFFFFFFFF

def set_reg(name, value):
    value &= 0xFFFFFFFFFFFFFFFF
    gdb.execute("set var $%s = %d" % (name, value - (1 << 64) if value >> 63 else value), to_string=True)

def syscall_of(t):
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, t)) as f:
            return int(f.read().split()[0])
    except Exception:
        return -1

def entry_point():
    with open("/proc/%d/auxv" % pid, "rb") as f:
        data = f.read()
    for i in range(0, len(data) - 15, 16):
        key, val = struct.unpack_from("<QQ", data, i)
        if key == 9:  # AT_ENTRY: code no thread runs again, a safe return address
            return val
    raise RuntimeError("no AT_ENTRY")

# gdb's own `call` saves and rewrites the XSAVE state, which fails on CPUs whose XSAVE area it
# does not know (AMX, gdb 13: "Couldn't write extended state status"). The call is made by hand:
# general registers only, which is all a call from a syscall boundary needs back.
def manual_call(thread, args, data):
    thread.switch()
    saved = dict((r, reg(r)) for r in GP)
    ret = entry_point()
    area = (saved["rsp"] - 4096) & ~0xF
    gdb.selected_inferior().write_memory(area, data + b"\0")
    sp = area - 256 - 8
    gdb.selected_inferior().write_memory(sp, struct.pack("<Q", ret))
    bp = gdb.Breakpoint("*0x%x" % ret, internal=True)
    bp.thread = thread.num
    try:
        set_reg("rdi", area)
        set_reg("rsi", args[0])
        set_reg("orig_rax", -1)  # no syscall restart while our call runs
        set_reg("rsp", sp)
        set_reg("rip", fn)
        gdb.execute("continue", to_string=True)
        if reg("rip") != ret:
            raise RuntimeError("the call stopped at 0x%x instead of returning" % reg("rip"))
        return reg("rax")
    finally:
        thread.switch()
        for r in GP:
            set_reg(r, saved[r])
        bp.delete()

try:
    gdb.execute("set scheduler-locking on", to_string=True)
    gdb.execute("set unwindonsignal on", to_string=True)
    # Every thread is stopped now: the one seen asleep before gdb started, or else any other
    # that is in a lock-free call now (the first may have woken up in the meantime).
    chosen = None
    nr = -1
    threads = sorted(gdb.selected_inferior().threads(), key=lambda t: t.ptid[1] != tid)
    for t in threads:
        n = syscall_of(t.ptid[1])
        if str(n) in safe:
            chosen, nr = t, n
            break
    if chosen is None:
        print("NPUSNAP-ATTACH unsafe %d" % nr)
    else:
        handle = manual_call(chosen, (2,), lib.encode())
        print("NPUSNAP-ATTACH handle %d %s %d" % (handle, safe[str(nr)], chosen.ptid[1]))
except Exception as exc:
    print("NPUSNAP-ATTACH error %s" % exc)
print("NPUSNAP-ATTACH stopped %.6f" % (time.monotonic() - t0))
gdb.execute("detach")
"""


def is_native_npu_process(pid: int) -> bool:
    """True when ``pid`` maps the CANN runtime and no libpython/python executable."""
    if acl.loaded_acl_library(pid) is None:
        return False
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return False
    return not exe.startswith("python") and "libpython" not in maps


def _dynsym_value(path: str, name: str) -> Optional[int]:
    """st_value of the defined dynamic symbol ``name`` of the library ``path``."""
    try:
        with elf.open_elf(path) as lib:
            sym = lib.symbol(name)
    except (OSError, elf.ElfError):
        return None
    return sym.value if sym else None


def dlopen_address(pid: int) -> int:
    """The address of dlopen in ``pid`` (glibc 2.34+ has it in libc.so.6, older in libdl)."""
    bases: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and int(parts[2], 16) == 0:
            bases.setdefault(parts[5].strip(), int(parts[0].split("-")[0], 16))
    for path, base in bases.items():
        name = os.path.basename(path)
        if name.startswith(("libc.so", "libc-", "libdl.so", "libdl-")):
            value = _dynsym_value(path, "dlopen")
            if value:
                return base + value
    raise TargetError(
        f"cannot find dlopen in pid {pid}",
        why="neither libc nor libdl of the process exports it (not a glibc process?)",
        fix="start the program with `npusnap run -- CMD` instead",
        details={"pid": pid},
    )


def _safe_thread(pid: int) -> Optional[tuple[int, str]]:
    """A thread of ``pid`` blocked in a lock-free system call, as (tid, syscall name)."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    for tid in tids:
        try:
            nr = int(Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if nr in SAFE_SYSCALLS:
            return tid, SAFE_SYSCALLS[nr]
    return None


class TraceWatch:
    """How long ``pid`` was traced, seen from outside while gdb runs.

    A thread reads TracerPid in /proc/PID/status every ``POLL_S``; the target's threads can be
    stopped only while it is traced. The window runs from the last look that saw it untraced
    before to the first that saw it untraced again (so a watcher that was scheduled late widens
    it, never narrows it), plus ``MARGIN_S`` for gdb detaching the other threads after the main
    one. ``stopped_s(wall)`` is that window, never more than gdb's whole run ``wall``, which is
    the bound when no window was seen (gdb's start-up before it attaches is in ``wall``, not in
    the window: on a busy machine it is most of it).
    """

    POLL_S = 0.001
    MARGIN_S = 0.01

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npusnap-tracewatch", daemon=True)

    def _traced(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"TracerPid:"):
                        return line.split()[1] != b"0"
        except OSError:
            pass
        return False

    def _run(self) -> None:
        untraced_at = time.monotonic()
        inside = False
        while True:
            stopping = self._stop.is_set()
            traced = self._traced()
            now = time.monotonic()
            if traced and not inside:
                inside = True
                if self.first is None:
                    self.first = untraced_at
            if traced:
                self.last = now  # still traced: the window reaches at least here
            elif inside:
                inside = False
                self.last = now  # the first look that saw it untraced again
            else:
                untraced_at = now
            if stopping:
                return
            self._stop.wait(self.POLL_S)

    def __enter__(self) -> TraceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def stopped_s(self, wall: float) -> float:
        if self.first is None or self.last is None:
            return round(wall, 3)
        window = self.last - self.first + self.MARGIN_S
        return round(min(wall, window), 3)


def _run_gdb(argv: list[str], budget: float, pid: int) -> str:
    """Run gdb to its end; its stdout and stderr.

    gdb runs in a session of its own, so that Ctrl-C at the terminal does not reach it, and it is
    never SIGKILLed while it may be inside the hand-made call: that would leave the target with a
    half-made call frame. Ctrl-C or a timeout asks it to stop with SIGTERM (gdb then detaches) and
    waits for that, bounded; only a gdb that ignores SIGTERM is killed.
    """
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    interrupted: Optional[BaseException] = None
    try:
        out, _ = proc.communicate(timeout=budget)
        return out
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        interrupted = exc
    proc.terminate()
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    if isinstance(interrupted, KeyboardInterrupt):
        raise interrupted
    raise AgentError(
        f"gdb did not finish within {budget:.0f}s attaching to pid {pid}; it was stopped",
        why="the target may be stuck in dlopen",
        fix=f"check `npusnap status {pid}` and the process itself",
    )


def _check_machine(pid: int) -> str:
    """gdb's path, after checking that this machine and ``pid`` are ones the hand-made call supports."""
    if platform.machine() != "x86_64":
        raise PreflightError(
            f"attaching to a native process is implemented for x86-64 only, not {platform.machine()}",
            why="the choice of a safe thread reads x86-64 system call numbers",
            fix="start the program with `npusnap run -- CMD`",
        )
    gdb = shutil.which("gdb")
    if gdb is None:
        raise PreflightError(
            "gdb is not installed",
            why="attach uses gdb to make the target load the agent",
            fix="apt install gdb",
        )
    return gdb


@dataclass(frozen=True)
class Loaded:
    """A library dlopened in the target: on which thread, at which safe point, and how long the
    target was stopped (TraceWatch, an upper bound)."""

    tid: int
    safe_point: str  # "syscall:<name>"
    stopped_s: float


def dlopen_in(pid: int, path: str, deadline: float, give_up: Optional[float] = None) -> Optional[Loaded]:
    """Make ``pid`` dlopen ``path`` (as the target sees it) on a thread blocked in a lock-free
    system call, without gdb reading any symbols.

    Returns None when no thread was at such a point by ``give_up`` (monotonic; default: the
    ``deadline``), so that a caller with another way in can take it; raises on any other failure.
    The target is stopped only while gdb has it traced (``stopped_s``: TraceWatch, an upper bound).
    """
    gdb = _check_machine(pid)
    until = deadline if give_up is None else min(give_up, deadline)
    addr = dlopen_address(pid)
    safe = {str(k): v for k, v in SAFE_SYSCALLS.items()}
    with tempfile.TemporaryDirectory(prefix="npusnap-gdbcall-") as scratch:
        script = Path(scratch) / "inject.py"
        # gdb opens every library of the process to map its sections even when it reads no
        # symbols (a large job: hundreds of files, most of the stop); looked for under an empty
        # directory, none is found and none is opened. The call needs none of them.
        nowhere = Path(scratch) / "no-sysroot"
        nowhere.mkdir()
        while True:
            found = _safe_thread(pid)
            if found is not None:
                tid, _name = found
                script.write_text(GDB_SCRIPT.format(pid=pid, tid=tid, addr=addr, lib=path, safe=safe))
                left = max(1.0, deadline - time.monotonic())
                t0 = time.monotonic()
                with TraceWatch(pid) as watch:
                    out = _run_gdb(
                        [
                            gdb,
                            "-nx",
                            "-batch",
                            "-iex",
                            "set auto-solib-add off",
                            "-iex",
                            "set pagination off",
                            "-iex",
                            f"set sysroot {nowhere}",
                            "-p",
                            str(pid),
                            "-x",
                            str(script),
                        ],
                        left + 5,
                        pid,
                    )
                wall = time.monotonic() - t0
                stopped = watch.stopped_s(wall)
                if "NPUSNAP-ATTACH handle" in out:
                    fields = out.split("NPUSNAP-ATTACH handle", 1)[1].split()
                    if int(fields[0]) == 0:
                        raise AgentError(
                            f"dlopen of {os.path.basename(path)} failed in pid {pid}",
                            why="the process could not load it (see its stderr)",
                            fix="start the program with `npusnap run -- CMD`",
                        )
                    used = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else tid
                    return Loaded(tid=used, safe_point=f"syscall:{fields[1]}", stopped_s=stopped)
                if "NPUSNAP-ATTACH error" in out:
                    raise AgentError(
                        f"loading the agent into pid {pid} failed: "
                        + out.split("NPUSNAP-ATTACH error", 1)[1].splitlines()[0].strip(),
                        why="gdb could not make the chosen thread call dlopen",
                        fix="start the program with `npusnap run -- CMD`",
                    )
                if "NPUSNAP-ATTACH unsafe" not in out:
                    raise AgentError(
                        f"gdb could not attach to pid {pid}",
                        why=out.strip()[-500:],
                        fix="check ptrace permissions (see docs/runbooks/permissions.md)",
                    )
            if time.monotonic() >= until:
                return None
            time.sleep(0.01)


def inject(pid: int, uid: int, gid: int, library: Path, timeout: float) -> Loaded:
    """dlopen the agent library into ``pid`` through gdb."""
    _check_machine(pid)
    if os.stat(f"/proc/{pid}/root") != os.stat("/"):
        raise TargetError(
            f"pid {pid} runs in another mount namespace (a container)",
            why="the agent library path would not be the same inside it",
            fix="start the program with `npusnap run -- CMD` inside the container",
        )
    deadline = time.monotonic() + timeout
    workdir = Path(tempfile.mkdtemp(prefix="npusnap-nattach-"))
    try:
        os.chmod(workdir, 0o700)
        copy = workdir / library.name
        shutil.copyfile(library, copy)
        os.chmod(copy, 0o700)
        (workdir / MARKER_NAME).write_bytes(b"")
        for p in (workdir, copy, workdir / MARKER_NAME):
            os.chown(p, uid, gid)
        done = dlopen_in(pid, str(copy), deadline)
        if done is None:
            raise TargetError(
                f"no thread of pid {pid} reached a safe point within {timeout:g}s",
                why="every thread was running or waiting on a lock; loading the agent then could "
                "deadlock the process",
                fix=f"retry `npusnap attach {pid}`, or start the program with `npusnap run -- CMD`",
            )
        return done
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
