"""gdb driver for `npusnap attach` on Python 3.9-3.13: make the target dlopen() our payload safely.

Run by npusnap_cli/device/attach/inject.py as::

    gdb --batch -nx -iex 'set non-stop on' ... -p PID -x gdb_inject.py

inside gdb's own Python (not the target's, not npusnap's). Inputs come from the environment:
NPUSNAP_ATTACH_PAYLOAD (the per-attach copy of libnpusnap_attach.so, as the target sees it),
NPUSNAP_ATTACH_REPORT (where to write the JSON result), NPUSNAP_ATTACH_BUDGET (seconds this
script may take in all) and NPUSNAP_ATTACH_BREAK_WAIT (seconds per breakpoint round).

Why it is careful: the only code run on a borrowed thread is dlopen(), and only where that
thread holds no allocator or loader lock, because a thread stopped at an arbitrary instruction
may be inside malloc() or the dynamic loader and a nested dlopen() there deadlocks or corrupts
the heap. Two kinds of safe points are used, in this order, in rounds until the budget ends:

1. the entry of a libpython function that Python threads call at clean points
   (PyEval_SaveThread/RestoreThread around blocking calls, the object allocator on almost every
   bytecode that creates an object): a busy Python thread gets there within microseconds;
2. a thread stopped *inside a blocking system call* (clock_nanosleep for time.sleep, select,
   poll, read, futex waits, ...), as /proc/PID/task/TID/syscall shows, whose stack has no
   allocator, loader, fork or stdio frame: this is what a process that sleeps, waits on a lock
   or sits in a long C call offers. The syscall is restarted when the thread resumes.

gdb runs in non-stop mode so that every other thread keeps running during the call (a thread
that holds a lock the call needs can release it), and it always detaches, leaving no
breakpoint behind.
"""

import json
import os
import re
import threading
import time

import gdb  # type: ignore[import-not-found]  # provided by gdb itself

PAYLOAD = os.environ["NPUSNAP_ATTACH_PAYLOAD"]
REPORT = os.environ["NPUSNAP_ATTACH_REPORT"]
BUDGET = float(os.environ.get("NPUSNAP_ATTACH_BUDGET", "6"))
BREAK_WAIT = float(os.environ.get("NPUSNAP_ATTACH_BREAK_WAIT", "0.3"))
START = time.monotonic()

RTLD_NOW = 2
MAX_FRAMES = 48
MAX_THREADS_REPORTED = 64

# Function entries that CPython reaches only from clean points, with the GIL held.
SAFE_BREAKPOINTS = ("PyEval_SaveThread", "PyEval_RestoreThread", "PyObject_Malloc", "PyMem_Malloc")

# Blocking system calls by architecture (numbers from the kernel's syscall tables).
# restart_syscall is how the kernel resumes an interrupted nanosleep/poll/futex wait after a
# ptrace stop, so every sleeping thread shows it once gdb has stopped it.
BLOCKING_SYSCALLS = {
    "x86_64": {
        0: "read",
        7: "poll",
        23: "select",
        34: "pause",
        35: "nanosleep",
        43: "accept",
        45: "recvfrom",
        47: "recvmsg",
        61: "wait4",
        128: "rt_sigtimedwait",
        130: "rt_sigsuspend",
        202: "futex",
        219: "restart_syscall",
        230: "clock_nanosleep",
        232: "epoll_wait",
        247: "waitid",
        270: "pselect6",
        271: "ppoll",
        281: "epoll_pwait",
        288: "accept4",
        299: "recvmmsg",
        441: "epoll_pwait2",
        449: "futex_waitv",
    },
    "aarch64": {
        22: "epoll_pwait",
        63: "read",
        72: "pselect6",
        73: "ppoll",
        95: "waitid",
        98: "futex",
        101: "nanosleep",
        115: "clock_nanosleep",
        128: "restart_syscall",
        133: "rt_sigsuspend",
        137: "rt_sigtimedwait",
        202: "accept",
        207: "recvfrom",
        212: "recvmsg",
        242: "accept4",
        243: "recvmmsg",
        260: "wait4",
        441: "epoll_pwait2",
        449: "futex_waitv",
    },
}
# futex operations that wait (FUTEX_WAIT, FUTEX_LOCK_PI, FUTEX_WAIT_BITSET, FUTEX_LOCK_PI2,
# FUTEX_WAIT_REQUEUE_PI); a thread in FUTEX_WAKE is not blocked.
FUTEX_WAIT_OPS = {0, 6, 9, 11, 13}
FUTEX_CMD_MASK = 0x7F

# Frames that mean "this thread may hold an allocator, loader, stdio or thread-list lock".
UNSAFE_EXACT = {
    "malloc",
    "free",
    "calloc",
    "realloc",
    "reallocarray",
    "memalign",
    "posix_memalign",
    "aligned_alloc",
    "valloc",
    "pvalloc",
    "cfree",
    "int_malloc",
    "int_free",
    "int_realloc",
    "int_memalign",
    "malloc_consolidate",
    "sysmalloc",
    "systrim",
    "arena_get2",
    "libc_malloc",
    "libc_free",
    "libc_calloc",
    "libc_realloc",
    "lll_lock_wait_private",
    "pthread_create",
    "allocate_stack",
    "fork",
    "Fork",
    "libc_fork",
    "vfork",
    "run_exit_handlers",
    "exit",
    "backtrace",
}
UNSAFE_PREFIXES = ("dl", "libc_dl", "IO_", "tcache", "nptl_", "Unwind_", "uw_", "malloc_", "elf_")


def normalize(name):
    """`__GI___clock_nanosleep`, `clock_nanosleep@GLIBC_2.17` -> `clock_nanosleep`."""
    name = name.split("@", 1)[0]
    name = re.sub(r"^(__GI_|__libc_|___)", lambda m: "libc_" if m.group(1) == "__libc_" else "", name)
    return name.lstrip("_")


def unsafe_frame(name):
    n = normalize(name)
    return n in UNSAFE_EXACT or n.startswith(UNSAFE_PREFIXES)




def elapsed():
    return time.monotonic() - START


def inferior():
    return gdb.selected_inferior()


# Captured once on gdb's main thread: the helper thread below must not call the gdb API.
PID = inferior().pid
MACHINE = os.uname().machine


def read_syscall(tid):
    """(syscall name, raw line) for a thread blocked in a listed syscall, else (None, raw line).

    /proc/PID/task/TID/syscall shows the syscall whether the thread is blocked in it or was
    stopped by ptrace while in it (the kernel restarts it when the thread resumes).
    """
    try:
        with open("/proc/%d/task/%d/syscall" % (PID, tid)) as f:
            raw = f.read().strip()
    except OSError as exc:
        return None, "unreadable: %s" % exc
    fields = raw.split()
    if not fields or not fields[0].isdigit():
        return None, raw  # "running", or "-1 sp pc": not in a syscall
    name = BLOCKING_SYSCALLS.get(MACHINE, {}).get(int(fields[0]))
    if name == "futex" and len(fields) > 2 and int(fields[2], 16) & FUTEX_CMD_MASK not in FUTEX_WAIT_OPS:
        return None, raw
    return name, raw


def blocked_tids(exclude):
    """Threads blocked in a listed syscall right now (read from /proc, safe while they run)."""
    try:
        tids = sorted(int(t) for t in os.listdir("/proc/%d/task" % PID))
    except OSError:
        return []
    # The main thread (tid == pid) first: it is the one that usually sleeps for the workload.
    tids.sort(key=lambda t: t != PID)
    return [tid for tid in tids if tid not in exclude and read_syscall(tid)[0] is not None]


# gdb reads no library's symbols by itself (`set auto-solib-add off`): reading those of a large
# job (hundreds of libraries, a JAX or PyTorch process) stops it for seconds. It reads those of
# the libraries the driver needs (the interpreter's, for the breakpoints; libc's and the loader's,
# for dlopen and the allocator/loader frames it must recognise), and those of any library that
# shows up in the stack of a thread it examines (so that the stack unwinds through it).
ESSENTIAL_LIBS = ("libpython", "libc\\.so", "libc-", "ld-linux", "libpthread", "libdl")
_loaded_libs = set()


def load_symbols(pattern):
    if pattern in _loaded_libs:
        return
    _loaded_libs.add(pattern)
    try:
        gdb.execute("sharedlibrary %s" % pattern, to_string=True)
    except gdb.error:
        pass


def _lib_pattern(path):
    """A `sharedlibrary` regexp for exactly this library (its file name, dots escaped)."""
    base = os.path.basename(path)
    if not re.match(r"^[A-Za-z0-9_.+-]+$", base):
        return "."  # an odd name: read them all (slow, but correct)
    # "+" (libstdc++) is literal in a basic regexp and a repetition in an extended one: "." fits both.
    return "/" + base.replace(".", "\\.").replace("+", ".") + "$"


def frames_of(thread):
    """The stopped thread's stack as [{'name', 'lib'}], innermost first; reads the symbols of the
    libraries on it first (they are not read up front)."""
    for _ in range(8):
        out, missing = _unwind(thread)
        new = [p for p in (_lib_pattern(lib) for lib in missing) if p not in _loaded_libs]
        if not new:
            return out
        for pattern in new:
            load_symbols(pattern)
    return out


def _unwind(thread):
    out = []
    missing = []
    try:
        thread.switch()
        frame = gdb.newest_frame()
        while frame is not None and len(out) < MAX_FRAMES:
            lib = None
            try:
                lib = gdb.solib_name(frame.pc())
            except gdb.error:
                pass
            out.append({"name": frame.name() or "??", "lib": os.path.basename(lib) if lib else None})
            if lib and frame.name() is None and lib not in missing:
                missing.append(lib)
            frame = frame.older()
    except gdb.error as exc:
        out.append({"name": "<unwind error: %s>" % exc, "lib": None})
    return out, missing


def describe_threads(stacks=True):
    """What every thread is doing (stacks of the stopped ones), for the diagnostics.

    Without ``stacks`` only what /proc says: unwinding every thread of a large job (dozens of
    threads) while all of them are stopped, right after the attach, would lengthen its stop."""
    threads = []
    for th in sorted(inferior().threads(), key=lambda t: t.num)[:MAX_THREADS_REPORTED]:
        tid = th.ptid[1]
        syscall, raw = read_syscall(tid)
        entry = {"tid": tid, "name": th.name, "syscall": syscall, "syscall_raw": raw}
        if stacks and th.is_stopped():
            entry["frames"] = frames_of(th)[:16]
        threads.append(entry)
    return threads


class Waiter:
    """One round: let every thread run until one hits a breakpoint, or stop one blocked thread.

    gdb's Python cannot pump gdb's event loop, but a synchronous `continue -a` does, and in
    non-stop mode it returns as soon as any one thread stops. A helper thread waits
    `break_wait` seconds for a breakpoint hit, then looks in /proc for a thread blocked in a
    listed syscall and has gdb (on its main thread, via post_event) interrupt only that one; at
    the deadline it interrupts every thread. Early returns (the stops that complete gdb's
    attach to each thread arrive one by one after `attach` returns) just continue again.
    """

    def __init__(self, exclude):
        self.exclude = exclude
        self.waiting = False
        self.wake = threading.Event()
        self.fired = None  # None: not yet; a tid; or "all"

    def _interrupt(self, tid):
        # Runs on gdb's main thread; only interrupt while our continue is still waiting.
        if not self.waiting:
            return
        for th in inferior().threads():
            if tid is not None and th.ptid[1] == tid and not th.is_stopped():
                self.fired = tid
                th.switch()
                gdb.execute("interrupt", to_string=True)
                return
        self.fired = "all"
        gdb.execute("interrupt -a", to_string=True)

    def _timer(self, break_wait, deadline):
        self.wake.wait(break_wait)
        while self.waiting:
            tids = blocked_tids(self.exclude)
            if tids or time.monotonic() >= deadline:
                tid = tids[0] if tids else None
                gdb.post_event(lambda: self._interrupt(tid))
                return
            self.wake.wait(0.05)

    def _done(self, deadline):
        threads = [th for th in inferior().threads() if th.is_valid()]
        for th in threads:
            if th.is_stopped():
                th.switch()
                if normalize(gdb.newest_frame().name() or "") in SAFE_BREAKPOINTS:
                    return True
        if self.fired == "all" or time.monotonic() > deadline + 1.0:
            return True
        return any(th.ptid[1] == self.fired and th.is_stopped() for th in threads)

    def run(self, break_wait, deadline):
        self.waiting = True
        self.fired = None
        self.wake.clear()
        timer = threading.Thread(target=self._timer, args=(break_wait, deadline), daemon=True)
        timer.start()
        try:
            while True:
                gdb.execute("continue -a", to_string=True)
                if self._done(deadline):
                    break
        finally:
            self.waiting = False
            self.wake.set()
        timer.join()


def choose_thread(exclude):
    """A stopped thread at a safe point: at one of our breakpoints, or blocked in a syscall.

    Returns (thread, method) or (None, None); adds syscall threads with unsafe stacks to `exclude`.
    """
    stopped = [th for th in inferior().threads() if th.is_valid() and th.is_stopped()]
    for th in stopped:
        th.switch()
        name = normalize(gdb.newest_frame().name() or "")
        if name in SAFE_BREAKPOINTS and not any(unsafe_frame(f["name"]) for f in frames_of(th)[1:]):
            return th, "breakpoint:" + name
    candidates = []
    for th in stopped:
        syscall, _ = read_syscall(th.ptid[1])
        if syscall is None:
            continue
        frames = frames_of(th)
        if any(unsafe_frame(f["name"]) for f in frames):
            exclude.add(th.ptid[1])
            continue
        candidates.append((th.ptid[1] != PID, th.num, th, "syscall:" + syscall))
    if not candidates:
        return None, None
    candidates.sort(key=lambda c: (c[0], c[1]))
    return candidates[0][2], candidates[0][3]


def resume_others(chosen):
    """Let every other thread run during the call, so a lock holder can release its lock."""
    for th in inferior().threads():
        if th.ptid != chosen.ptid and th.is_valid() and th.is_stopped():
            th.switch()
            gdb.execute("continue &", to_string=True)
    chosen.switch()


# Registers saved around a hand-made call (x86-64). gdb's own `call` also saves and rewrites the
# extended (XSAVE) state, which fails on CPUs whose XSAVE area gdb does not know (AMX:
# "Couldn't write extended state status: Bad address" with gdb 13 on kernel 6.x). A call made
# at a function entry or at a syscall boundary only needs the general registers back: every
# vector register is caller-saved there, so dlopen may clobber them.
_GP_REGS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11",
            "r12", "r13", "r14", "r15", "rip", "eflags", "orig_rax")


def _reg(name):
    return int(gdb.selected_frame().read_register(name)) & 0xFFFFFFFFFFFFFFFF


def _set_reg(name, value):
    gdb.execute("set var $%s = %d" % (name, _signed(value)), to_string=True)


def _signed(value):
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >> 63 else value


def _entry_point():
    """AT_ENTRY from the target's auxv: code no thread runs again, a safe return address."""
    import struct

    with open("/proc/%d/auxv" % PID, "rb") as f:
        data = f.read()
    for i in range(0, len(data) - 15, 16):
        key, val = struct.unpack_from("<QQ", data, i)
        if key == 9:  # AT_ENTRY
            return val
    raise RuntimeError("no AT_ENTRY in /proc/%d/auxv" % PID)


def _address(fn):
    value = gdb.parse_and_eval(fn)
    return int(value.address if value.address is not None else value) & 0xFFFFFFFFFFFFFFFF


def manual_call(thread, fn, args, data=b""):
    """Call `fn(args...)` (integers; the string `data` is passed as a pointer where an arg is
    None) on the stopped `thread` by setting its registers, and return rax."""
    if MACHINE != "x86_64":
        raise RuntimeError("hand-made calls are implemented for x86-64 only")
    thread.switch()
    saved = {r: _reg(r) for r in _GP_REGS}
    ret_addr = _entry_point()
    area = (saved["rsp"] - 4096) & ~0xF  # far below the red zone and the current frame
    ptr = area
    if data:
        inferior().write_memory(ptr, data + b"\0")
    sp = area - 256  # 16-byte aligned
    sp -= 8  # the return address: at the callee's entry (rsp + 8) % 16 == 0
    inferior().write_memory(sp, ret_addr.to_bytes(8, "little"))
    bp = gdb.Breakpoint("*0x%x" % ret_addr, internal=True, temporary=False)
    bp.thread = thread.num
    regs = ("rdi", "rsi", "rdx", "rcx")
    try:
        for reg, val in zip(regs, args):
            _set_reg(reg, ptr if val is None else val)
        _set_reg("orig_rax", -1)  # no syscall restart while our call runs
        _set_reg("rsp", sp)
        _set_reg("rip", fn)
        gdb.execute("continue", to_string=True)  # non-stop: only this thread; returns when it stops
        if _reg("rip") != ret_addr:
            raise RuntimeError("the call stopped at 0x%x (a signal?) instead of returning" % _reg("rip"))
        return _reg("rax")
    finally:
        thread.switch()
        for r in _GP_REGS:
            _set_reg(r, saved[r])
        bp.delete()


def call_dlopen(thread):
    """dlopen(PAYLOAD, RTLD_NOW) on the stopped `thread`. Returns (ok, detail)."""
    for fn in ("dlopen", "__libc_dlopen_mode"):
        try:
            addr = _address(fn)
        except gdb.error as exc:
            if "No symbol" in str(exc):
                continue
            return False, "finding %s in the target failed: %s" % (fn, exc)
        try:
            handle = manual_call(thread, addr, (None, RTLD_NOW), PAYLOAD.encode())
        except (gdb.error, RuntimeError) as exc:
            return False, "calling %s in the target failed: %s" % (fn, exc)
        if handle:
            return True, "%s returned 0x%x" % (fn, handle)
        reason = ""
        try:
            msg = manual_call(thread, _address("dlerror"), ())
            if msg:
                reason = inferior().read_memory(msg, 512).tobytes().split(b"\0", 1)[0].decode(errors="replace")
        except (gdb.error, RuntimeError):
            pass
        return False, "%s failed in the target: %s" % (fn, reason or "no reason given")
    return False, "the target has no dlopen (a static binary without the dynamic loader?)"


def main():
    report = {"ok": False, "method": None, "tid": None, "detail": None, "rounds": 0, "threads": []}
    breakpoints = []
    try:
        # A signal that reaches the borrowed thread during the call must not leave it inside a
        # half-run call frame: unwind it. Ordinary signals pass through without stopping the
        # target, so they do not interrupt the call in the first place.
        gdb.execute("set unwindonsignal on", to_string=True)
        gdb.execute("handle all nostop noprint pass", to_string=True)
        for sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
            gdb.execute("handle %s stop print pass" % sig, to_string=True)
        for pattern in ESSENTIAL_LIBS:
            load_symbols(pattern)
        report["threads"] = describe_threads(stacks=False)
        for name in SAFE_BREAKPOINTS:
            try:
                breakpoints.append(gdb.Breakpoint(name, internal=True))
            except (gdb.error, RuntimeError):
                pass
        report["breakpoints"] = len(breakpoints)
        exclude = set()
        waiter = Waiter(exclude)
        chosen = method = None
        deadline = START + BUDGET - 0.5  # keep time to detach
        while chosen is None and time.monotonic() < deadline:
            report["rounds"] += 1
            for bp in breakpoints:
                bp.enabled = True
            waiter.run(min(BREAK_WAIT, max(0.0, deadline - time.monotonic())), deadline)
            for bp in breakpoints:
                bp.enabled = False
            chosen, method = choose_thread(exclude)
        for bp in breakpoints:
            bp.delete()
        breakpoints = []
        if chosen is None:
            report["threads"] = describe_threads()
            report["detail"] = "no thread reached a safe point within %.1fs" % BUDGET
            return report
        report["method"] = method
        report["tid"] = chosen.ptid[1]
        resume_others(chosen)
        report["ok"], report["detail"] = call_dlopen(chosen)
        return report
    except Exception as exc:  # report it; the caller detaches in any case
        report["detail"] = "gdb driver error: %s: %s" % (type(exc).__name__, exc)
        return report
    finally:
        for bp in breakpoints:
            try:
                bp.delete()
            except Exception:
                pass


def finish(report):
    report["elapsed_s"] = round(elapsed(), 3)
    tmp = REPORT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, REPORT)


_report = main()
try:
    gdb.execute("detach", to_string=True)
    _report["detached"] = True
except gdb.error as _exc:
    _report["detached"] = False
    _report["detach_error"] = str(_exc)
finish(_report)
