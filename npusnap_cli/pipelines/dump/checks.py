"""The dump's checks (``CHECKS``), in the order the dump runs them: each step runs its share and
`dump --dry-run` runs them all. They only read: the dry run runs them against live jobs."""

from __future__ import annotations

import shutil
from typing import Optional

from npusnap_cli import acl
from npusnap_cli.device.devicegroup import refuse_stopped
from npusnap_cli.errors import PreflightError
from npusnap_cli.host import pidns, preflight, procfs, qualifyreport
from npusnap_cli.image import imagetrust, layout
from npusnap_cli.pipelines import checks
from npusnap_cli.pipelines.dump.agents import _connect, _hello
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.target import _rss, resolve_target
from npusnap_cli.pipelines.dump.treechecks import (
    _check_criu,
    _check_external_stdio,
    _check_host_files,
    _check_npu_plugin,
    _check_other_users,
    _check_session,
    _check_space_and_memory,
    _check_tcp,
    _check_undumpable_fds,
)
from npusnap_cli.units import human_bytes

# The dump's checks, in the order the dump runs them (each step of steps.py runs its share, and
# `dump --dry-run` runs them all, also after a problem). Cheap checks first: bad input must fail
# before anything touches the target. Privileges before all: as a user, root's job looks like a
# tree without an NPU process.


def _c_privileges(s: DumpState) -> str:
    preflight.require_privileges("dump")
    return "root"


def _c_directory(s: DumpState) -> str:
    layout.check_dump_target(s.final, force=s.options.force)
    return f"{s.final} can be written"


def _c_signing_key(s: DumpState) -> str:
    assert s.options.sign_key is not None
    imagetrust.check_signing_key(s.options.sign_key)
    return f"{s.options.sign_key} signs"


def _c_target(s: DumpState) -> str:
    s.resolved.found = resolve_target(s.pid, attach=s.options.attach)
    t = s.target
    idle = (
        f"; without device state though their agent cannot answer (stopped, or no agent of their own): "
        f"{', '.join(map(str, t.idle))}"
        if t.idle
        else ""
    )
    return f"{len(t.tree)} process(es), {len(t.npu_pids)} on the NPU: {', '.join(map(str, t.npu_pids))}{idle}"


def _c_users(s: DumpState) -> str:
    _check_other_users(s.target.tree)
    return "CRIU may read every process's limits"


def _c_session(s: DumpState) -> str:
    _check_session(s.target.tree, shell_job=s.options.criu.shell_job)
    return "a shell job (--shell-job)" if s.options.criu.shell_job else "the tree leads its own session"


def _c_stdio(s: DumpState) -> str:
    s.resolved.external = _check_external_stdio(s.target.tree, s.options, s.cb.note)
    return (
        f"{len(s.resolved.external)} pipe(s) for restore --pipe-to"
        if s.resolved.external
        else "nothing CRIU cannot restore"
    )


def _c_criu(s: DumpState) -> str:
    s.resolved.criu_binary = _check_criu(s.check)
    return f"CRIU {s.binary.version}, `criu check` passed"


def _c_fds(s: DumpState) -> str:
    _check_undumpable_fds(s.target.tree, s.binary)
    return "CRIU can dump every descriptor"


def _c_tcp(s: DumpState) -> str:
    s.resolved.tcp_within = _check_tcp(s.target.tree, s.options, s.in_job, s.cb.note)
    return (
        "connections within the tree only"
        if s.resolved.tcp_within
        else "none to outside the tree unless asked for"
    )


def _c_namespaces(s: DumpState) -> str:
    tree = s.target.tree
    ns_map = pidns.namespace_pids(s.target.root_pid, [p.pid for p in tree])
    s.resolved.pid_ns = {str(k): v for k, v in ns_map.items()}
    s.resolved.device_view = pidns.in_device_view(s.target.root_pid)
    if s.resolved.device_view and shutil.which("nsenter") is None:
        raise PreflightError(
            f"pid {s.target.root_pid} runs in a container of the simulated NPU (`restore --device-map`) "
            "and nsenter is not installed",
            why="CRIU must run in the job's mount namespace to dump it without that namespace, "
            "which a restore could not rebuild; npusnap starts it there with nsenter",
            fix="install util-linux (apt-get install util-linux), then dump again; nothing was touched",
        )
    return ("its own pid namespace" if ns_map else "the host's pid namespace") + (
        ", in a device view (CRIU runs there)" if s.resolved.device_view else ""
    )


def _c_npu_plugin(s: DumpState) -> str:
    _check_npu_plugin(s.target.tree)
    return "CRIU can dump the device connections"


def _c_host_files(s: DumpState) -> str:
    _check_host_files(s.target.tree, s.options)
    return "what the image carries, its restore may write"


def _c_cgroups(s: DumpState) -> str:
    if not any(o.startswith("manage-cgroups") for o in s.options.criu.passthrough):
        return "cgroups are not dumped (no --criu-opt manage-cgroups)"
    for p in s.target.tree:
        split = procfs.threads_in_other_cgroups(p.pid)
        if split:
            raise PreflightError(
                f"pid {p.pid} has threads in other cgroups than its main thread ({split}); with "
                "--criu-opt manage-cgroups CRIU could dump it but not restore it; nothing was touched",
                why="CRIU 4.2.1 restores a thread left in the root cgroup set of such a process with "
                "'cgroupd: No set found' (criu/cgroup.c); an NPU process always has runtime threads, "
                "and a program that moves only its main thread (writing cgroup v1 `tasks`) leaves them",
                fix="move the whole process (cgroup.procs, not tasks), or dump without manage-cgroups",
                details={"pid": p.pid, "threads": split},
            )
    return "every process's threads share its cgroups"


def _c_stopped(s: DumpState) -> str:
    refuse_stopped(s.target.npu_pids, "dump")  # being checkpointed by someone else
    return "no NPU process is stopped"


def _c_space(s: DumpState) -> str:
    # The host side now; the device memory once the agents said how much they hold.
    s.resolved.host_bytes = sum(_rss(p.pid) for p in s.target.tree)
    _check_space_and_memory(s.final, s.resolved.host_bytes, 0)
    return f"room for {human_bytes(s.resolved.host_bytes)} of host memory"


def _c_qualified(s: DumpState) -> str:
    """The node's qualification report for the CANN the job's NPU processes have loaded."""
    for pid in s.target.npu_pids:
        library = acl.loaded_acl_library(pid)
        if library:
            home = acl.home_of_library(library)
            return qualifyreport.gate(qualifyreport.SeenCann.at(home), s.cb.note)
    return "no NPU process has a CANN library mapped"


def _c_agents(s: DumpState) -> str:
    """The dry run's share of the agents: their hello, as the dump's ``hello`` step asks it."""
    _connect(s)
    try:
        _hello(s)
    finally:
        s.group.close()
    return f"{len(s.agents.hello)} agent(s) unlocked, {human_bytes(s.agents.device_bytes)} of device memory"


def _no_target(s: DumpState) -> Optional[str]:
    return None if s.resolved.found is not None else "needs the process tree"


def _no_criu(s: DumpState) -> Optional[str]:
    return _no_target(s) or (None if s.resolved.criu_binary is not None else "needs CRIU")


def _no_agents(s: DumpState) -> Optional[str]:
    if s.resolved.found is None:
        return "needs the process tree"
    missing = ", ".join(map(str, _without_agent(s)))
    return f"the dump would attach an agent to pid(s) {missing} first" if missing else None


DumpCheck = checks.Check[DumpState]
INPUT_CHECKS: list[DumpCheck] = [
    DumpCheck("privileges", "the privileges CRIU needs", _c_privileges),
    DumpCheck("directory", "DIR is new or empty, its filesystem writable", _c_directory),
    DumpCheck(
        "signing-key",
        "the --sign key",
        _c_signing_key,
        skip=lambda s: None if s.options.sign_key is not None else "no --sign",
    ),
]
TARGET_CHECKS: list[DumpCheck] = [DumpCheck("target", "PID's tree and its NPU processes", _c_target)]
PREFLIGHT_CHECKS: list[DumpCheck] = [
    DumpCheck("users", "processes CRIU may read", _c_users, skip=_no_target),
    DumpCheck("session", "the session CRIU can record", _c_session, skip=_no_target),
    DumpCheck("stdio", "stdin/stdout/stderr to outside the tree", _c_stdio, skip=_no_target),
    DumpCheck("criu", "a CRIU that works on this kernel", _c_criu),
    DumpCheck("descriptors", "descriptors CRIU cannot dump", _c_fds, skip=_no_criu),
    DumpCheck("tcp", "TCP connections to outside the tree", _c_tcp, skip=_no_target),
    DumpCheck("namespaces", "pid and mount namespaces", _c_namespaces, skip=_no_target),
    DumpCheck("npu-plugin", "a CRIU plugin for the device connections", _c_npu_plugin, skip=_no_target),
    DumpCheck("qualified", "the node's qualification report", _c_qualified, skip=_no_target),
    DumpCheck("host-files", "host files the image carries", _c_host_files, skip=_no_target),
    DumpCheck("cgroups", "cgroups CRIU can restore", _c_cgroups, skip=_no_target),
]
ATTACH_CHECKS: list[DumpCheck] = [
    DumpCheck("stopped", "no NPU process is stopped", _c_stopped, skip=_no_target),
    DumpCheck("space", "room for the image and memory for the copy", _c_space, skip=_no_target),
]
# The dry run's own: the dump asks the agents in its hello step, after attaching missing ones.
AGENT_CHECKS: list[DumpCheck] = [
    DumpCheck("agents", "every NPU process's agent, unlocked; the device memory", _c_agents, skip=_no_agents),
]
CHECKS: list[DumpCheck] = [*INPUT_CHECKS, *TARGET_CHECKS, *PREFLIGHT_CHECKS, *ATTACH_CHECKS, *AGENT_CHECKS]


def _without_agent(s: DumpState) -> tuple[int, ...]:
    t = s.target
    return tuple(p.pid for p in t.tree if p.uses_npu and not p.has_agent and p.pid not in t.idle)
