"""The tree to dump: PID's processes and which of them run on the NPU (``resolve_target``), with
an agent attached where one is missing (``attach_missing``); and what /proc says of them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import paths
from npusnap_cli.device import attach as attach_mod
from npusnap_cli.errors import TargetError
from npusnap_cli.host import procfs, proctree
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.pipelines.callbacks import PhaseFn, no_phase


@dataclass(frozen=True)
class _Target:
    root_pid: int
    tree: tuple[ProcInfo, ...]  # root first
    npu_pids: tuple[int, ...]
    attached: tuple[int, ...] = ()
    attach_stopped_s: tuple[tuple[int, float], ...] = ()
    # Processes with the CANN runtime loaded that npusnap cannot ask (stopped, or their agent's
    # socket closed) and that never opened a device (host/agentrecord.py): CRIU dumps them as
    # any other process; they are not NPU processes of the image.
    idle: tuple[int, ...] = ()
    # Processes stopped by a signal before the dump (not traced): CRIU keeps them stopped, and
    # a rollback must not resume them either.
    stopped: tuple[int, ...] = ()
    # NPU processes whose only agent socket is another process's (a child forked a moment ago,
    # holding its parent's listening socket until it opens a device of its own): one that exits
    # before the agents are asked was never a rank of its own (agents.py, _gone_children).
    borrowed_socket: tuple[int, ...] = ()


def _signal_stopped(tree: list[ProcInfo]) -> tuple[int, ...]:
    out = []
    for p in tree:
        st = procfs.stop_state(p.pid)
        if st is not None and st[1] == 0:
            out.append(p.pid)
    return tuple(out)


def resolve_target(pid: int, *, attach: bool) -> _Target:
    """The tree of ``pid`` and its NPU processes; read-only (agents are attached later).

    Raises TargetError when the pid does not exist, when no process of the tree uses the NPU,
    or when one lacks an agent and ``attach`` is false.
    """
    tree = proctree.process_tree(pid)  # TargetError when pid does not exist
    idle = proctree.without_device_state(tree)
    npu = [p for p in tree if p.uses_npu and p.pid not in idle]
    if not npu:
        with_agent = [p.pid for p in tree if p.has_agent]
        raise TargetError(
            f"pid {pid} has no NPU process in its tree",
            why=(
                "no process under it has the CANN runtime loaded or an Ascend device open"
                + (f" (pids with an agent but no NPU: {with_agent})" if with_agent else "")
            ),
            fix="dump the process that runs on the NPU (see `npusnap status PID`); "
            "a process without NPU state needs plain `criu dump`",
            details={"pids": [p.pid for p in tree]},
        )
    missing = [p.pid for p in npu if not p.has_agent]
    for m in missing:
        owner = paths.fd_table_owner(m)
        if owner is not None:
            raise TargetError(
                f"pid {m} shares its descriptor table with pid {owner} (clone with CLONE_FILES) and "
                "has no agent of its own; npusnap dump changed nothing",
                why="a process made by clone(CLONE_FILES) without fork ran no fork handler, so no agent "
                "started in it, and one cannot be attached beside its parent's socket: npusnap "
                "could not park or save a CANN runtime it may use",
                fix="start such children with fork() or posix_spawn(), or dump a tree without them",
                details={"pid": m, "shares_fd_table_with": owner},
            )
    # An agent that is loaded starts listening within milliseconds (a child forked a moment ago);
    # one that is loaded and stays silent cannot be attached beside either.
    deadline = time.monotonic() + AGENT_LISTEN_S
    while [m for m in missing if proctree.agent_loaded(m)] and time.monotonic() < deadline:
        time.sleep(0.05)
        tree = proctree.process_tree(pid)
        idle = proctree.without_device_state(tree)
        npu = [p for p in tree if p.uses_npu and p.pid not in idle]
        missing = [p.pid for p in npu if not p.has_agent]
    for m in missing:
        if proctree.agent_loaded(m):
            raise TargetError(
                f"pid {m} has an npusnap agent loaded that does not listen; npusnap dump changed nothing",
                why="the program closed the agent's descriptors (a daemon closing every fd it inherited "
                "does), stopped it (npusnap_cli.agent.stop()), or it could not start (its log says "
                "why), or it listens in another runtime directory than this command's "
                "(NPUSNAP_RUNTIME_DIR); attaching a second agent beside it would add descriptors and "
                "a second server the program did not ask for",
                fix=f"read {paths.agent_log_path(m)}; run npusnap with the job's NPUSNAP_RUNTIME_DIR, "
                "restart the agent in the program (npusnap_cli.agent.start()), or leave descriptors "
                "the program did not open alone",
                details={"pid": m},
            )
    if missing and not attach:
        raise TargetError(
            f"NPU process(es) without an agent: {', '.join(map(str, missing))}",
            why="their device state can only be saved from inside them, by an agent; --no-attach was given",
            fix=" ; ".join(f"npusnap attach {m}" for m in missing) + " (or drop --no-attach)",
            details={"without_agent": missing},
        )
    return _Target(
        root_pid=pid,
        tree=tuple(tree),
        npu_pids=tuple(p.pid for p in npu),
        idle=idle,
        stopped=_signal_stopped(tree),
        borrowed_socket=tuple(
            p.pid for p in npu if p.has_agent and not proctree.named_after(p.agent_socket, p.pid)
        ),
    )


# How long a loaded agent may take to listen before the dump says it does not.
AGENT_LISTEN_S = 2.0


def attach_missing(target: _Target, note: PhaseFn = no_phase) -> _Target:
    """Inject an agent into every NPU process of ``target`` that has none; the refreshed target."""
    missing = [p.pid for p in target.tree if p.uses_npu and not p.has_agent and p.pid not in target.idle]
    if not missing:
        return target
    stopped: list[tuple[int, float]] = []
    for m in missing:
        # A child forked a moment ago that has already exited is no part of what CRIU freezes.
        if not procfs.is_alive(m):
            note(f"pid {m} exited before it could be attached: it is not part of the snapshot")
            continue
        note(f"pid {m} has no agent: attaching one")
        try:
            result = attach_mod.attach(m)
        except TargetError:
            if procfs.is_alive(m):
                raise
            note(f"pid {m} exited while it was being attached: it is not part of the snapshot")
            continue
        if result.stopped_s is not None:
            stopped.append((m, result.stopped_s))
    tree = proctree.process_tree(target.root_pid)
    npu = [p for p in tree if p.uses_npu and p.pid not in target.idle]
    still = [p.pid for p in npu if not p.has_agent]
    if still:
        raise TargetError(
            f"attach reported success but pid(s) {still} have no agent socket",
            why="the injected agent did not start listening",
            fix="read the agent log (<runtime dir>/<pid>.log); try `npusnap attach PID -v`",
        )
    return _Target(
        root_pid=target.root_pid,
        tree=tuple(tree),
        npu_pids=tuple(p.pid for p in npu),
        attached=tuple(missing),
        attach_stopped_s=tuple(stopped),
        idle=target.idle,
        stopped=target.stopped,
        borrowed_socket=target.borrowed_socket,
    )


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _our_mount_ns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False
