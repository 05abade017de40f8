"""``attach``: an agent that answers hello in the target, the one already there or one injected
(``attach_native`` for a process that is not Python)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

from npusnap_cli import paths, replies
from npusnap_cli.agent import native
from npusnap_cli.device import native_attach
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.device.attach.bootstrap import AGENT_BODY
from npusnap_cli.device.attach.inject import DEFAULT_TIMEOUT, diagnose, inject
from npusnap_cli.device.attach.probe import _check_permissions, _comm, _proc_state, _status_fields, probe
from npusnap_cli.errors import AgentError, PreflightError, TargetError
from npusnap_cli.jsontypes import JSONObject, as_str


@dataclass(frozen=True)
class AttachResult:
    pid: int
    method: str  # "already-present", "gdb" or "remote_exec"
    python: str
    socket: Optional[str]
    elapsed_s: float
    safe_point: Optional[str] = None
    tid: Optional[int] = None
    hello: Optional[replies.HelloReply] = None
    notes: tuple[str, ...] = ()  # things the operator should know (reported by the bootstrap)
    # How long the job could not run because of the attach (an upper bound; None: nothing was
    # injected): traced by gdb (native_attach.TraceWatch) plus, in a Python target, the time the
    # bootstrap held the GIL. ``stop`` has the parts.
    stopped_s: Optional[float] = None
    stop: dict[str, Optional[float]] = field(default_factory=dict)

    def to_dict(self) -> JSONObject:
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
            "hello": self.hello.to_json() if self.hello is not None else {},
            "notes": list(self.notes),
        }


# -- attach ----------------------------------------------------------------------------------------
def _hello(pid: int, timeout: float, retry_s: float) -> replies.HelloReply:
    with AgentClient(pid, timeout=timeout, connect_retry_s=retry_s) as client:
        return client.hello()


def existing_agent(pid: int) -> Optional[replies.HelloReply]:
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
            socket=hello.socket,
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
        socket=hello.socket,
        elapsed_s=time.monotonic() - start,
        safe_point=done.safe_point,
        tid=done.tid,
        hello=hello,
        stopped_s=done.stopped_s,
        stop={"ptrace_s": done.stopped_s, "gil_s": None},
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
            socket=hello.socket,
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
    if hello.pid != pid:
        raise AgentError(
            f"the agent socket of pid {pid} answered for pid {hello.pid}",
            why="another process serves the socket name",
            details={"pid": pid, "hello": hello.to_json()},
        )
    return AttachResult(
        pid=pid,
        method=result.method,
        python=target.version_str,
        socket=hello.socket or as_str(result.status.get("socket")),
        elapsed_s=time.monotonic() - start,
        safe_point=result.safe_point,
        tid=result.tid,
        hello=hello,
        notes=tuple(str(n) for n in [result.status.get("note")] if n),
        stopped_s=result.stopped_s,
        stop={"ptrace_s": result.ptrace_stopped_s, "gil_s": result.gil_s},
    )
