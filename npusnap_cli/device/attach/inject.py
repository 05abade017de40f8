"""Running the bootstrap inside the target: ``sys.remote_exec`` (3.14+) or the payload dlopened
by gdb; and, when that fails, what the target is doing (``diagnose``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import paths
from npusnap_cli.device import native_attach
from npusnap_cli.device.attach.bootstrap import (
    BOOTSTRAP_NAME,
    STATUS_NAME,
    _Workdir,
    _workdir,
    _write_private,
    bootstrap_source,
)
from npusnap_cli.device.attach.probe import PythonTarget, _proc_state, _read, _status_fields, ptrace_scope
from npusnap_cli.errors import AgentError, PreflightError, TargetError
from npusnap_cli.host import procfs
from npusnap_cli.jsontypes import JSONObject, JSONValue, array, as_int, as_str, obj, req_float

DEFAULT_TIMEOUT = 10.0
PAYLOAD_NAME = "libnpusnap_attach.so"
GDB_SCRIPT_NAME = "gdb_inject.py"
# How long one breakpoint round waits before the driver looks for a thread blocked in a syscall.
BREAK_WAIT_S = 0.25
# gdb needs this much beyond the driver's own budget to start, read symbols and detach.
GDB_STARTUP_S = 15.0
# How long to look for a thread asleep in a lock-free system call (the symbol-free way in,
# native_attach.dlopen_in) before falling back to breakpoints, which need gdb to read symbols.
FAST_WINDOW_S = 1.0


@dataclass(frozen=True)
class InjectResult:
    """The bootstrap ran inside the target and reported ``status``."""

    pid: int
    method: str  # "gdb" or "remote_exec"
    safe_point: Optional[str]  # gdb: "breakpoint:<function>" or "syscall:<name>"
    tid: Optional[int]  # gdb: the thread that called dlopen
    status: JSONObject  # what the bootstrap reported (bootstrap.py): "ok", "socket", "gil_s", ...
    elapsed_s: float
    # How long the target was stopped by ptrace (native_attach.TraceWatch: an upper bound); None
    # for sys.remote_exec, which does not stop it.
    ptrace_stopped_s: Optional[float] = None

    @property
    def gil_s(self) -> Optional[float]:
        """How long the bootstrap held the GIL, as it reported it (None: it did not say)."""
        value = self.status.get("gil_s")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def stopped_s(self) -> float:
        """The longest the job could not run because of the attach (an upper bound): stopped by
        ptrace, then its Python threads waiting while the bootstrap held the GIL."""
        return round((self.ptrace_stopped_s or 0.0) + float(self.gil_s or 0.0), 3)


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
        gdb_report: JSONObject = {}
        stopped: Optional[float] = None
        if target.method == "remote_exec":
            _remote_exec(target, f"{wd.target}/{BOOTSTRAP_NAME}", deadline)
        else:
            _place_payload(target, wd)
            fast = _fast_inject(target, wd, deadline)
            if fast is not None:
                safe_point, tid, stopped = fast.safe_point, fast.tid, fast.stopped_s
            else:
                gdb_report = _gdb_inject(target, wd, deadline)
                stopped = req_float(gdb_report, "stopped_s")
                safe_point = as_str(gdb_report.get("method"))
                tid = as_int(gdb_report.get("tid"))
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


def _fast_inject(target: PythonTarget, wd: _Workdir, deadline: float) -> Optional[native_attach.Loaded]:
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
    target: PythonTarget, wd: _Workdir, deadline: float, gdb_report: Mapping[str, JSONValue]
) -> JSONObject:
    path = wd.host / STATUS_NAME
    while True:
        if path.exists():
            try:
                status = _json_object(path)
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
    details: JSONObject = {"pid": target.pid, "interpreter": exe, "stderr": err[-2000:]}
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


def _json_object(path: Path) -> JSONObject:
    """The JSON object in ``path`` (a status or report our own code in the target wrote: free-form,
    forwarded in an error's details); ValueError if it is not one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def _gdb_inject(target: PythonTarget, wd: _Workdir, deadline: float) -> JSONObject:
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
        report = _json_object(report_path)
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


def _short_report(report: Mapping[str, JSONValue]) -> JSONObject:
    return {k: report.get(k) for k in ("ok", "method", "tid", "detail", "rounds", "elapsed_s") if k in report}


def diagnose(pid: int, gdb_report: Optional[Mapping[str, JSONValue]] = None) -> JSONObject:
    """What the target is doing: process state, wchan, and each thread's top frames if gdb saw them."""
    scope = ptrace_scope()
    info: JSONObject = {
        "pid": pid,
        "alive": os.path.exists(f"/proc/{pid}"),
        "state": _proc_state(pid),
        "wchan": (_read(f"/proc/{pid}/wchan") or "").strip() or None,
        "ptrace_scope": scope if scope is not None else "no Yama",
        "gdb": find_gdb(),
        "tracer_pid": int(_status_fields(pid).get("TracerPid", "0") or 0),
    }
    threads: list[JSONObject] = []
    gdb_threads = {obj(t).get("tid"): obj(t) for t in array((gdb_report or {}).get("threads"))}
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        tids = []
    for tid in tids[:64]:
        entry: JSONObject = {
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
                for f in map(obj, list(array(seen.get("frames")))[:6])
            ]
        threads.append(entry)
    info["threads"] = threads
    if gdb_report:
        info["gdb_report"] = _short_report(gdb_report)
    return info


def _proc_state_task(pid: int, tid: int) -> str:
    st = procfs.stat(pid, tid)
    return st.state if st else ""
