"""The process tree of a target and what each process has to do with the NPU.

For every process under (and including) a pid: its agent socket if it has one, the CANN ACL
library if it is mapped (/proc/PID/maps), open Ascend device files (/dev/davinci*, devmm_svm,
hisi_hdc), its uid and command line. Reading another user's /proc entries may be refused; such
fields are None rather than an error, and ``readable`` says so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil

from npusnap_cli import acl, contract, paths, replies
from npusnap_cli.device import occupancy
from npusnap_cli.device.agent_client import NO_AGENT_FIX, PASSING_CLIENT_WAIT_S, AgentBusyError, AgentClient
from npusnap_cli.errors import NpusnapError, PreflightError, TargetError
from npusnap_cli.host import agentrecord, devmaps, oplog, procfs
from npusnap_cli.jsontypes import JSONObject


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    depth: int
    uid: Optional[int]
    name: str
    cmdline: tuple[str, ...]
    agent_socket: Optional[str]
    acl_library: Optional[str]
    device_files: tuple[str, ...] = field(default_factory=tuple)
    readable: bool = True
    # Exited but not yet reaped by its parent: CRIU dumps (and restores) it as a zombie, so it
    # belongs to the tree an image describes, though it has no memory, files or agent.
    zombie: bool = False

    @property
    def has_agent(self) -> bool:
        return self.agent_socket is not None

    @property
    def uses_npu(self) -> bool:
        """The CANN runtime is loaded or an Ascend device file is open."""
        return self.acl_library is not None or bool(self.device_files)

    def to_dict(self) -> JSONObject:
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "depth": self.depth,
            "uid": self.uid,
            "name": self.name,
            "cmdline": list(self.cmdline),
            "agent_socket": self.agent_socket,
            "acl_library": self.acl_library,
            "device_files": list(self.device_files),
            "uses_npu": self.uses_npu,
            "readable": self.readable,
            "zombie": self.zombie,
        }


def _agent_socket(pid: int, listening: set[str]) -> Optional[str]:
    found = paths.find_agent_socket(pid, sorted(listening))
    return str(found) if found is not None else None


def describe(proc: psutil.Process, depth: int, listening: set[str]) -> ProcInfo:
    pid = proc.pid
    readable = True
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return _zombie(proc, depth)
        with proc.oneshot():
            ppid = proc.ppid()
            name = proc.name()
            uid: Optional[int] = proc.uids().effective
            try:
                cmdline = tuple(proc.cmdline())
            except psutil.AccessDenied:
                cmdline, readable = (), False
    except psutil.NoSuchProcess:
        raise
    except psutil.AccessDenied:
        ppid, name, uid, cmdline, readable = 0, "?", None, (), False
    devices = devmaps.device_files(pid)  # the NPU device files it holds open
    library = acl.loaded_acl_library(pid)
    if devices is None:
        readable = False
    return ProcInfo(
        pid=pid,
        ppid=ppid,
        depth=depth,
        uid=uid,
        name=name,
        cmdline=cmdline,
        agent_socket=_agent_socket(pid, listening),
        acl_library=library,
        device_files=tuple(devices or ()),
        readable=readable,
    )


def _zombie(proc: psutil.Process, depth: int) -> ProcInfo:
    """A zombie of the tree: its pid, parent, owner and name (its command line went with its
    memory)."""
    try:
        uid: Optional[int] = proc.uids().effective
    except psutil.AccessDenied:
        uid = None
    return ProcInfo(
        pid=proc.pid,
        ppid=proc.ppid(),
        depth=depth,
        uid=uid,
        name=proc.name(),
        cmdline=(),
        agent_socket=None,
        acl_library=None,
        zombie=True,
    )


def process_tree(pid: int) -> list[ProcInfo]:
    """``pid`` and all its descendants, pre-order (parents before children), root first."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise TargetError(
            f"no process with pid {pid}",
            why="it exited, or it lives in another PID namespace",
            fix="check the pid with `ps -p PID` and rerun",
        ) from None
    # The tree's own network namespace (a job on another "node"): /proc/net is ours.
    listening = set(paths.listening_unix_paths(f"/proc/{pid}/net/unix") or paths.listening_unix_paths())
    out: list[ProcInfo] = []

    def walk(proc: psutil.Process, depth: int) -> None:
        try:
            info = describe(proc, depth, listening)
            children = sorted(proc.children(), key=lambda p: p.pid)
        except psutil.NoSuchProcess:
            if depth == 0:
                raise TargetError(f"process {pid} exited while it was being inspected") from None
            return  # a child exited meanwhile: it is not part of the tree any more
        out.append(info)
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    _require_readable(pid, out)
    return out


def _require_readable(pid: int, tree: list[ProcInfo]) -> None:
    """As a user, another user's processes hide their maps and fds: the tree would look like one
    without an NPU process or an agent, a wrong answer. Say that root is what is missing."""
    euid = os.geteuid()
    if euid == 0:
        return
    hidden = [p for p in tree if not p.readable and not p.zombie]
    if not hidden:
        return
    owners = sorted({p.uid for p in hidden if p.uid is not None})
    whose = f"uid {', '.join(map(str, owners))}" if owners else "another user"
    raise PreflightError(
        f"pid {hidden[0].pid} belongs to {whose}: looking into another user's process needs root "
        f"(npusnap runs as uid {euid})",
        why="/proc hides another user's open files and memory maps, and the job's agent answers "
        "only its own user and root",
        fix=f"run the command as root (`sudo npusnap ... {pid}`), or as the job's user",
        details={"pids": [p.pid for p in hidden], "owners": owners, "euid": euid},
    )


def npu_processes(tree: list[ProcInfo]) -> list[ProcInfo]:
    """The processes of a tree that use the NPU (those a snapshot must lock): the CANN runtime
    loaded or a device file open, less those that never opened a device and whose agent cannot
    answer (:func:`without_device_state`)."""
    idle = without_device_state(tree)
    return [p for p in tree if p.uses_npu and p.pid not in idle]


def agent_loaded(pid: int) -> bool:
    """The native agent is mapped into ``pid`` (npusnap run, or an earlier attach)."""
    return agentrecord.agent_mapping(pid) is not None


def named_after(socket: Optional[str], pid: int) -> bool:
    """The agent socket is named after ``pid`` (as this pid namespace, or its own, sees it)."""
    names = {contract.AGENT_SOCKET_NAME.format(pid=n) for n in [pid, *procfs.ns_pids(pid)]}
    return socket is not None and os.path.basename(socket) in names


def without_device_state(tree: list[ProcInfo]) -> tuple[int, ...]:
    """The processes of ``tree`` with the runtime loaded whose agent cannot answer and that never
    opened a device (host/agentrecord.py), which a snapshot leaves to CRIU: stopped by a signal
    (not traced: a tracer is a checkpoint in progress), with the agent loaded and not listening
    (a forked child before its first device call, a program that closed the agent's socket), or
    holding only another process's agent socket (a copy made by clone() without fork handlers)."""
    out = []
    for p in tree:
        if not p.uses_npu:
            continue
        stopped = procfs.stop_state(p.pid)
        unreachable = (
            (stopped is not None and stopped[1] == 0)
            or (not p.has_agent and agent_loaded(p.pid))
            or (p.has_agent and not named_after(p.agent_socket, p.pid))
        )
        if unreachable and agentrecord.never_opened_a_device(p.pid):
            out.append(p.pid)
    return tuple(out)


def tree_status(pid: int, timeout: float = 5.0) -> dict[str, Any]:
    """``{"pid", "processes": [...], "hints": [...]}``; agent failures are reported per process."""
    tree = process_tree(pid)
    idle = without_device_state(tree)
    processes: list[dict[str, Any]] = []
    hints: list[str] = []
    for info in tree:
        entry: dict[str, Any] = info.to_dict()
        # Its agent cannot answer, and it never opened a device: a snapshot leaves it to CRIU.
        entry["without_device_state"] = info.pid in idle
        # "devices": the physical devices it holds (device/occupancy.py), what a restore compares;
        # "program_devices": the ids its program uses, which differ in a container.
        entry.update({"hello": None, "status": None, "agent_error": None, "devices": None})
        entry.update({"program_devices": None, "ns_pid": occupancy.ns_pid(info.pid)})
        hello: Optional[replies.HelloReply] = None
        if info.has_agent and info.pid not in idle:  # a stopped one's agent cannot answer
            # An agent serves one client at a time: the command that just ended (a restore's
            # last request) may still hold it for a moment. Asked again for a while, unless a
            # running command holds it (a long dump), which `status` names instead.
            try:
                with AgentClient(
                    info.pid,
                    timeout=timeout,
                    connect_retry_s=0.5,
                    busy_wait_s=PASSING_CLIENT_WAIT_S,
                    held_by_command=functools.partial(oplog.held_by_command, info.pid),
                ) as client:
                    hello = client.hello()
                    entry["hello"] = hello.to_json()
                    entry["status"] = client.status().to_json()
                entry.pop("agent_error", None)
            except AgentBusyError as exc:
                hello = None
                entry.pop("hello", None)
                entry["agent_error"] = exc.to_dict()
            except NpusnapError as exc:
                hello = None
                entry["agent_error"] = exc.to_dict()
        if hello is not None:
            use = occupancy.of_hello(info.pid, hello)
            entry["devices"] = list(use.devices or ())
            entry["program_devices"] = list(use.program_devices)
        elif (info.uses_npu and info.pid not in idle) or info.pid == pid:
            hints.append(f"pid {info.pid} has no npusnap agent: " + NO_AGENT_FIX.format(pid=info.pid))
        processes.append(entry)
    return {"pid": pid, "processes": processes, "hints": hints}


def tree_pids(root_pid: int) -> list[int]:
    """The tree of ``root_pid`` as it is now (children first), for the final kill."""
    try:
        root = psutil.Process(root_pid)
        kids = root.children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in reversed(kids)] + [root_pid]


def signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is running (gone or a zombie); return the ones still there."""
    end = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < end:
        left = [p for p in left if procfs.is_alive(p)]
        if left:
            time.sleep(0.02)
    return left
