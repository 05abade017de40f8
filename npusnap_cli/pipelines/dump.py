"""The dump pipeline: NPU processes locked and backed up, the tree dumped by CRIU, the image published.

design.md §3, in order:

1. resolve the tree of PID and its NPU processes (attach where an agent is missing);
2. preflight (CRIU, privileges, DIR, free space against the expected image, host RAM against
   the device bytes);
3. Lock + Backup every NPU process in parallel under a lease (``DeviceGroup``);
4. close the agent connections, CRIU dump of the whole tree into a temporary sibling of DIR;
5. publish (checksums, manifest, fsync, the checks of ``verify`` on the complete work
   directory, rename), then the original tree is killed — or, with ``leave_running``, every NPU
   process is unlocked and keeps running. The manifest lists exactly what CRIU dumped (zombies
   included), and host files its restore would refuse are refused at preflight: a dump never
   reports success for an image its own restore refuses.

Never lose the job: CRIU dumps with ``leave_stopped`` rather than letting CRIU kill the tree, so
that the original is killed only once the image is safely on disk; until then every failure
(CRIU refused or crashed, disk full, a device call or an agent failed, Ctrl-C / SIGTERM) rolls
every locked process back to RUNNING and removes the partial image; if npusnap itself dies while
the tree is stopped, ``StopGuard``'s watcher resumes it and the leases roll it back. If the
rollback itself fails the error is ``StateUnknownError`` with the commands to inspect and recover.

The steps (``STEPS``, at the end) run on the pipeline engine (engine.py), over a ``DumpState``:
each step's undo is its share of that rollback, and ``_failed`` says on the way out what was
rolled back and where the discarded image's logs went. A job dump runs the same steps per rank
with the job's barriers (jobsnap.py).

Core module: returns frozen dataclasses, reports progress through ``DumpCallbacks``, never prints.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import __version__, acl, contract, criu, paths
from npusnap_cli import image as img
from npusnap_cli.criu import CriuOptions
from npusnap_cli.device import attach as attach_mod
from npusnap_cli.device.devicegroup import DeviceGroup, forget_taken_over, refuse_stopped
from npusnap_cli.device.leasekeeper import LeaseKeeper, keeping
from npusnap_cli.errors import (
    CriuError,
    DeviceError,
    ImageError,
    NpusnapError,
    PreflightError,
    StateUnknownError,
    TargetError,
)
from npusnap_cli.host import (
    agentrecord,
    criuplugin,
    devmaps,
    hostclean,
    hostres,
    pidns,
    preflight,
    procfs,
    proctree,
    tcpunlock,
)
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.image import devchunks, digest, imagetrust, streamhash
from npusnap_cli.image.streamhash import FileHasher, StreamHasher, WritebackFollower
from npusnap_cli.pipelines import checks
from npusnap_cli.pipelines.callbacks import PhaseFn, PipelineCallbacks, no_phase
from npusnap_cli.pipelines.engine import Barrier, Pipeline, SignalGuard, Step, describe
from npusnap_cli.units import human_bytes

DEFAULT_LEASE_S = 60.0
# Headroom on top of the expected image size: CRIU's own metadata, the manifest, filesystem slack.
SPACE_MARGIN_BYTES = 16 << 20
SPACE_MARGIN_FACTOR = 1.10
# Cores from which the device-memory files are hashed alongside CRIU's dump: one for CRIU, one for
# the hash, the rest for the disk's writeback and the kernel. With fewer they are hashed once CRIU
# is done, on every core: with fewer cores, hashing alongside slows CRIU and keeps the job frozen
# longer for no shorter dump (docs/benchmarks.md, "Measurements behind design choices").
HASH_ALONGSIDE_CRIU_CORES = 4
_POLL_S = 0.2

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
DumpCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class DumpOptions:
    """What `npusnap dump` was asked to do: CRIU's options as given (CRIU/podman names and
    meanings), and npusnap's own."""

    criu: CriuOptions = field(default_factory=CriuOptions)
    keep: bool = False
    force: bool = False
    attach: bool = True
    lease_s: float = DEFAULT_LEASE_S
    # Pipes to outside the tree on stdin/out/err recorded for `restore --pipe-to` (hostres.py).
    external_pipes: bool = False
    sign_key: Optional[Path] = None  # Ed25519 private key (PEM): sign the manifest (imagetrust)
    device_memory: str = contract.DEFAULT_DEVICE_MEMORY_MODE  # docs/device-memory.md
    # How long each agent waits for its devices to drain after Lock; None: 10 s, or
    # DRAIN_TIMEOUT_GROUP_S for a tree of several NPU processes.
    drain_timeout_s: Optional[float] = None
    # Lock attempts after a device that did not drain; None: 1, or BUSY_RETRIES_GROUP for a tree of
    # several NPU processes (a job dump sets 0 and retries all its ranks together).
    busy_retries: Optional[int] = None
    # An earlier image of the job whose device-memory chunks this one may share, besides the
    # images next to it (devchunks.py).
    parent: Optional[Path] = None

    @property
    def leave_running(self) -> bool:
        return self.criu.leave_running

    def criu_for(self, tree: tuple[ProcInfo, ...], tcp_within: bool = False) -> CriuOptions:
        """What CRIU is asked for ``tree``: unless it runs on, the tree stays stopped after the
        dump (it is killed once the image is published), no network lock where it would lock
        nothing (a --network-lock given always wins), and --tcp-established when every TCP
        connection of the tree has both ends in it (``tcp_within``)."""
        o = self.criu
        tcp = o.tcp_established or tcp_within
        return replace(
            o,
            leave_stopped=not o.leave_running,
            tcp_established=tcp,
            network_lock=o.network_lock or _unneeded_network_lock(tree, tcp),
        )


@dataclass(frozen=True)
class DumpOutcome:
    image: str
    manifest: img.Manifest
    attached: tuple[int, ...] = ()
    logs: Optional[str] = None
    # pid -> how long the dump's attach stopped it (upper bound; the manifest keeps the longest)
    attach_stopped_s: tuple[tuple[int, float], ...] = ()
    # What the stale-temp cleanup did next to DIR (removed, recovered, refused: one line each).
    leftovers: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        timings: dict[str, Any] = dict(m.timings.to_dict())
        return {
            "image": self.image,
            "leftovers": list(self.leftovers),
            "created_at": m.created_at,
            "root_pid": m.root_pid,
            "npu_pids": [p.pid for p in m.npu_processes],
            "pids": [p.pid for p in m.processes],
            "leave_running": m.leave_running,
            "attached": list(self.attached),
            # A job stalls while attach stops it too, not only while it is frozen for the dump.
            "attach_stopped": {str(p): s for p, s in self.attach_stopped_s},
            "logs": self.logs,
            "timings": timings,
            "bytes": m.bytes.to_dict(),
            "versions": m.versions.to_dict(),
            "processes": [p.to_dict() for p in m.processes],
            "device_memory": dict(m.device_memory),
        }


# --------------------------------------------------------------------------------------------
# Resolve and preflight
# --------------------------------------------------------------------------------------------


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
        note(f"pid {m} has no agent: attaching one")
        result = attach_mod.attach(m)
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


def _first(*values: Any) -> Optional[float]:
    return next((float(v) for v in values if v is not None), None)


def _sum(*values: Any) -> Optional[float]:
    known = [float(v) for v in values if v is not None]
    return sum(known) if known else None


def _check_other_users(tree: tuple[ProcInfo, ...]) -> None:
    problem = preflight.other_user_problem([p.uid for p in tree if p.uid is not None])
    if problem:
        raise PreflightError(
            f"cannot dump: {problem.detail}",
            why="CRIU reads every process's rlimits (prlimit), which needs CAP_SYS_RESOURCE for "
            "another user's process",
            fix=problem.fix,
        )


def _check_session(tree: tuple[ProcInfo, ...], *, shell_job: bool) -> None:
    """Refuse, before anything is locked, the two session layouts CRIU is certain to refuse."""
    outside = [p.pid for p in tree if procfs.session_id(p.pid) == 0]
    if outside:
        raise PreflightError(
            f"cannot dump pid(s) {', '.join(map(str, outside))}: their session leader is outside "
            "this pid namespace",
            why="the job was started by a process outside this container or pid namespace "
            "(docker exec, nsenter, a CI runner); CRIU cannot record such a session, even with "
            "--shell-job",
            fix="start the job with `npusnap run -- CMD...` (it gives such a job a session of its own) "
            "or with `setsid`",
            details={"pids": outside},
        )
    root = tree[0].pid
    sid = procfs.session_id(root)
    if sid is not None and sid != root and not shell_job:
        raise PreflightError(
            f"pid {root} is not a session leader: it shares session {sid} (a shell or a launcher)",
            why="CRIU dumps a tree that shares another process's session only as a shell job "
            "(the session itself is not saved; the restored job gets a new one)",
            fix="rerun with --shell-job (restore reads it from the image), or start the job "
            "with `setsid` next time",
            details={"pid": root, "session": sid},
        )


def _check_external_stdio(
    tree: tuple[ProcInfo, ...], options: DumpOptions, note: PhaseFn
) -> tuple[hostres.ExternalStdio, ...]:
    """Refuse pipes/terminals to outside the tree on stdin/out/err (the restored job would die
    of them); with --external-pipes, the pipes are recorded for `restore --pipe-to` instead."""
    found = hostres.find_external_stdio([p.pid for p in tree])
    for e in hostres.stray_pipes(found):
        if not options.external_pipes:
            note(
                f"pid {e.pid}'s fd {e.fd} is a pipe shared with pid(s) {list(e.peers)} outside the tree: "
                "restored without its other end (a write to it fails); --external-pipes with "
                "restore --pipe-to FILE reconnects it"
            )
    if options.external_pipes:
        ttys = [e for e in found if e.kind == "tty"]
        err = hostres.external_stdio_error(ttys, shell_job=options.criu.shell_job)
        if err is not None:
            raise err
        return tuple(e for e in found if e.kind == "pipe")
    err = hostres.external_stdio_error(found, shell_job=options.criu.shell_job)
    if err is not None:
        raise err
    return ()


def _check_undumpable_fds(tree: tuple[ProcInfo, ...], binary: criu.CriuBinary) -> None:
    """Refuse descriptors CRIU cannot dump (io_uring, perf events...) before anything is locked."""
    found = preflight.find_undumpable_fds([p.pid for p in tree], preflight.criu_has_libbpf(binary.path))
    err = preflight.undumpable_fds_error(found)
    if err is not None:
        raise err


def _check_tcp(tree: tuple[ProcInfo, ...], options: DumpOptions, in_job: bool, note: PhaseFn) -> bool:
    """Established TCP connections, before anything is locked. True when the tree has some and
    every one has both ends in the tree (a PyTorch store and its clients, ranks of one tree):
    CRIU dumps and restores such pairs whole, so the dump asks for --tcp-established itself.
    A connection to outside the tree without --tcp-established is refused here: CRIU would fail
    on it after the job was locked. (A rank of a job dump: its peers are other ranks; left to
    the job's options.)"""
    if options.criu.tcp_established or in_job:
        return False
    held = tcpunlock.tree_connections([p.pid for p in tree if not p.zombie])
    if not held:
        return False
    outside = tcpunlock.outside_peers(held)
    if outside:
        pid, (lip, lport, rip, rport) = outside[0]
        more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
        raise PreflightError(
            f"pid {pid} has a TCP connection {lip}:{lport} -> {rip}:{rport} to outside the tree{more}",
            why="CRIU dumps an established connection only with --tcp-established, and it would "
            "fail on this one after the job was locked",
            fix="add --tcp-established: the restore then needs the peer there on the same addresses, "
            "or drops such connections with `restore --tcp-close`",
            details={
                "connections": [
                    {"pid": p, "local": f"{a}:{b}", "remote": f"{c}:{d}"} for p, (a, b, c, d) in outside
                ]
            },
        )
    count = sum(len(conns) for _ns, conns in held.values())
    note(
        f"the tree's {count} TCP connection ends are all between its own processes: "
        "dumped with --tcp-established"
    )
    return True


def _check_criu(check: Optional[criu.CriuCheck]) -> criu.CriuBinary:
    """The CRIU binary of ``check`` (started when the dump began; None: no usable CRIU was found
    then), once its ``criu check`` passed."""
    if check is None:
        check = criu.CriuCheck(criu.find_criu())  # raises the PreflightError that says why
    binary = check.binary
    passed, text = check.result()
    if not passed:
        raise PreflightError(
            f"`{binary.path} check` failed: CRIU cannot checkpoint on this kernel",
            why=text.splitlines()[-1] if text else "criu check printed nothing",
            fix="run `npusnap check` for details; ./scripts/setup.sh installs a working CRIU",
            details={"criu_check_output": text.splitlines()[-20:]},
        )
    return binary


def _host_file_paths(pids: list[int], file_locks: bool) -> list[str]:
    """The host files the dump copies into the image (at post-dump, while the tree is frozen):
    the tmpfs files the tree uses and, with --file-locks, the files it holds a lock on (lock
    files, often removed by the original when it exits)."""
    paths = hostres.find_tmpfs_files(pids)
    if file_locks:
        paths = sorted(set(paths) | set(hostres.find_locked_files(pids)))
    return paths


def _check_host_files(tree: tuple[ProcInfo, ...], options: DumpOptions) -> None:
    """Refuse, before anything is locked, host files the image would carry but its restore
    (and `npusnap verify`) would refuse to write: the very rules of restore
    (hostrecords.check_host_files) on the files the tree holds now. A lock file outside tmpfs
    where its owner could not have made it (a root job's lock in a root directory) is one:
    restore writes host files as root only where the job could have written them itself."""
    pids = [p.pid for p in tree if not p.zombie]
    paths = _host_file_paths(pids, options.criu.file_locks)
    if not paths:
        return
    files = hostres.planned_files(paths)
    ours = _our_mount_ns(tree[0].pid) or pidns.in_device_view(tree[0].pid)
    nodes = hostres.find_host_nodes(pids, paths) if ours else []
    uids = {p.uid if p.uid is not None else -1 for p in tree}
    problems = hostres.check_host_files(files, uids, nodes)
    if problems:
        locks = " (taken with --file-locks)" if options.criu.file_locks else ""
        raise PreflightError(
            f"cannot dump: the job holds a host file{locks} its restore would refuse to write: {problems[0]}",
            why="the image carries the files the job holds a lock on and its tmpfs files, and "
            "restore writes them back as root only on tmpfs or where their owner could have "
            "created them itself; an image that its restore refuses would lose the job",
            fix="move the file to a tmpfs directory (/dev/shm, a tmpfs /tmp) or to a directory its "
            "owner may write (for root's jobs: a sticky shared one such as /var/tmp), or dump "
            "without --file-locks if the job does not need its locks back; nothing was touched",
            details={"problems": problems, "files": paths},
        )


def _device_memory_in_process() -> bool:
    """``NPUSNAP_DEVMEM_IN_PROCESS=1``: the agents keep their copy of the device memory in the
    process's memory for CRIU to save (how it was done before the image's device files; the
    benchmarks compare the two)."""
    return os.environ.get("NPUSNAP_DEVMEM_IN_PROCESS") == "1"


def _device_memory_file_size(dm: dict[str, Any]) -> int:
    """What an agent's device-memory file will hold at most, from its hello: a 32-byte header,
    24 bytes per allocation, then the bytes of those not excluded (native/agent/devmem.c)."""
    try:
        count = int(dm.get("allocations") or 0)
        data = int(dm.get("bytes") or 0) - int(dm.get("excluded_bytes") or 0)
    except (TypeError, ValueError):
        return 0
    return 32 + 24 * count + max(0, data)


def _unneeded_network_lock(tree: tuple[ProcInfo, ...], tcp_established: bool) -> Optional[str]:
    """``"skip"`` where CRIU's network lock would lock nothing, so that the dump does not pay for
    it: a tree wholly in this host's network namespace is locked one TCP connection at a time,
    which only --tcp-established dumps have, yet CRIU's nftables method still creates its table up
    front, a large part of a small dump's CRIU time. None (CRIU's default method) for a
    tree in a network namespace of its own (CRIU locks the whole namespace) or with
    --tcp-established; a --network-lock on the command line always wins."""
    if tcp_established:
        return None
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        # A zombie has no namespaces left (its /proc/PID/ns/net is gone).
        if all(os.stat(f"/proc/{p.pid}/ns/net").st_ino == mine for p in tree if not p.zombie):
            return "skip"
    except OSError:
        pass
    return None


def _simulated_npu_pids(tree: tuple[ProcInfo, ...]) -> list[int]:
    """Processes of the tree that have the simulated NPU's runtime loaded (its CANN tree says
    Simulated in version.info): their device handle is a connection to the npusim daemon."""
    homes: dict[str, bool] = {}
    pids = []
    for p in tree:
        if not p.acl_library:
            continue
        home = acl.home_of_library(p.acl_library)
        if home not in homes:
            homes[home] = acl.read_version_info(home)[1]
        if homes[home]:
            pids.append(int(p.pid))
    return pids


def _check_npu_plugin(tree: tuple[ProcInfo, ...]) -> None:
    """Device handles need a CRIU plugin: real Ascend device files Huawei's, the simulated NPU's
    daemon connection this project's npusim_plugin.so. Missing or built for another CRIU: refused."""
    sim = _simulated_npu_pids(tree)
    if sim:
        item = preflight.check_npu_plugin(simulated=True)
        if item.data.get("path") is None:
            raise PreflightError(
                "the target uses the simulated NPU but CRIU has no plugin for its device connection",
                why="the simulated runtime keeps its connection to the npusim daemon (a unix socket) open "
                "across Lock and Backup, as real CANN keeps /dev/davinci* open; stock CRIU refuses it "
                f'("External socket is used"). npusim_plugin.so is not in {item.data.get("plugin_dir")}, '
                "the directory CRIU loads plugins from",
                fix=item.fix,
                details={"pids": sim, "plugin_dir": item.data.get("plugin_dir")},
            )
        if item.status == preflight.PROBLEM:
            raise PreflightError(
                f"the simulated NPU's CRIU plugin does not fit this CRIU: {item.detail}",
                why="CRIU calls a plugin's hooks by slot number; a plugin built against another "
                "criu-plugin.h calls the wrong functions",
                fix=item.fix,
                details={"plugin": item.data.get("path"), "pids": sim},
            )
    devfiles = sorted({f for p in tree for f in p.device_files})
    plugin = preflight.find_npu_plugin() if devfiles else None
    if devfiles and plugin is None:
        raise PreflightError(
            "the target has Ascend device files open but CRIU has no NPU plugin",
            why="stock CRIU cannot dump /dev/davinci* fds and device mappings; Huawei's CRIU "
            "plugin (npu_plugin.so) handles them",
            fix=criuplugin.ASCEND.install_fix + ", then retry",
            details={"device_files": devfiles},
        )
    if plugin is not None:
        item = preflight.check_npu_plugin_abi(plugin)
        if item.status == preflight.PROBLEM:
            raise PreflightError(
                f"the CRIU NPU plugin does not fit this CRIU: {item.detail}",
                why="CRIU calls a plugin's hooks by slot number; a plugin built against another "
                "criu-plugin.h calls the wrong functions",
                fix=item.fix,
                details={"plugin": plugin, "device_files": devfiles},
            )


def _check_space_and_memory(final: Path, expected_image: int, device_bytes: int) -> None:
    need = int(expected_image * SPACE_MARGIN_FACTOR) + SPACE_MARGIN_BYTES
    have = img.free_bytes(final.parent)
    if have < need:
        img.check_dump_target(final, force=True)  # a read-only filesystem: name that, not "0 B free"
        raise PreflightError(
            f"not enough free space for the image in {final.parent}: "
            f"{human_bytes(have)} free, about {human_bytes(need)} needed",
            why="the image holds the memory of every process of the tree plus the device memory",
            fix="free space there or dump to another filesystem",
            details={"free_bytes": have, "needed_bytes": need},
        )
    avail = _mem_available()
    if device_bytes and avail is not None and avail < device_bytes:
        raise PreflightError(
            f"not enough host memory to back up the device: {human_bytes(avail)} available, "
            f"{human_bytes(device_bytes)} of device memory",
            why="the agent keeps its copy of the device memory in the process's host memory "
            "(NPUSNAP_DEVMEM_IN_PROCESS=1) until CRIU dumps it",
            fix="free host memory (or stop other jobs) and retry",
            details={"mem_available": avail, "device_bytes": device_bytes},
        )


# After Lock every agent drains its devices (a bounded synchronize) before it copies: a device
# still busy at the deadline fails the attempt, everything is rolled back and it is tried again.
DRAIN_TIMEOUT_GROUP_S = 3.0
BUSY_RETRIES_GROUP = 5
BUSY_RETRIES = 1


# Host memory left over while the chunked device memory is staged in memory files.
CHUNK_STAGING_RESERVE = 512 << 20


def _empty_files(files: dict[int, tuple[int, str]]) -> None:
    """Before another lock attempt: the device-memory files from the start again."""
    for fd, _name in files.values():
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)


def agent_device_bytes(hello: dict[str, Any]) -> int:
    """The device memory an agent will copy (its records, less what the application excluded)."""
    dm = hello.get("device_memory") or {}
    try:
        return max(0, int(dm.get("bytes") or 0) - int(dm.get("excluded_bytes") or 0))
    except (TypeError, ValueError):
        return 0


# --------------------------------------------------------------------------------------------
# Device memory: is continuity guaranteed?
# --------------------------------------------------------------------------------------------

DEVICE_MEMORY_MODES = contract.DEVICE_MEMORY_MODES
CONTINUITY = {"preserve": "npusnap", "app": "application", "discard": "lost"}


def check_device_memory(
    mode: str,
    hello: dict[int, dict[str, Any]],
    maps: Optional[dict[int, Optional[devmaps.DeviceMemory]]] = None,
) -> dict[str, Any]:
    """What keeps each process's device memory across the snapshot; the manifest's record.

    CANN's Restore gives allocations back at their addresses, not their contents. In ``preserve``
    mode npusnap copies them itself, which needs the allocations to be known: seen by the
    preloaded library from the start (``npusnap run``: it tracks the driver's allocation calls) or
    registered by the application. Whether a process has device memory at all comes from what a
    real node offers: the agent's own records and devices, and the process's device mappings in
    /proc/PID/maps (host/devmaps.py) -- never from the simulator's daemon. A process with device
    memory that npusnap cannot see is refused (TargetError) unless the user chose ``app`` (the
    application's hooks save and reload it) or ``discard`` (it is lost, and restore says so).
    """
    if mode not in DEVICE_MEMORY_MODES:
        raise PreflightError(
            f"--device-memory must be one of {', '.join(DEVICE_MEMORY_MODES)}, not {mode!r}",
            fix="--device-memory preserve (the default), app or discard",
        )
    processes: dict[str, Any] = {}
    untracked: list[int] = []
    for pid, h in sorted(hello.items()):
        dm = h.get("device_memory") or {}
        acl_info = h.get("acl") or {}
        mapped = (maps or {}).get(pid)
        has_memory = bool(
            dm.get("bytes")
            or acl_info.get("devices")
            or acl_info.get("callback_devices")
            or (mapped and mapped.present)
        )
        tracked = bool(dm.get("interposed")) or int(dm.get("registered") or 0) > 0
        processes[str(pid)] = {
            "interposed": bool(dm.get("interposed")),
            "registered": int(dm.get("registered") or 0),
            "allocations": int(dm.get("allocations") or 0),
            "bytes": int(dm.get("bytes") or 0),
            "vmm_bytes": int(dm.get("vmm_bytes") or 0),
            "excluded_bytes": int(dm.get("excluded_bytes") or 0),
            "device_mappings": mapped.mappings if mapped else None,
        }
        if has_memory and not tracked:
            untracked.append(pid)
    if mode == "preserve" and untracked:
        pids = ", ".join(map(str, untracked))
        raise TargetError(
            f"cannot guarantee that pid(s) {pids} continue after a restore: npusnap does not know "
            "their device memory",
            why="CANN's Restore brings back every device allocation's address but not its contents; "
            "npusnap copies them itself, but only where it saw them being allocated (programs "
            "started with `npusnap run`) or the application registered them; an attached agent, "
            "or one started by the program itself without `npusnap run`, does not see them. "
            "These processes have device memory (device mappings in /proc/PID/maps, or devices the "
            "agent knows) that npusnap did not see being allocated",
            fix="start the job with `npusnap run -- CMD...`; or register its buffers "
            "(npusnap_cli.agent.register_buffer); or choose explicitly: --device-memory app "
            "(the application's hooks save and reload its device memory) or --device-memory "
            "discard (its device memory is lost; restore will say so)",
            details={"untracked_pids": untracked, "device_memory": processes},
        )
    return {"mode": mode, "continuity": CONTINUITY[mode], "processes": processes}


# --------------------------------------------------------------------------------------------
# Progress sampling in a background thread
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sampling(sample: Callable[[], int], report: Callable[[int], None]) -> Iterator[None]:
    """Call ``report(sample())`` every few hundred ms while the body runs (and once at the end)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(_POLL_S):
            with contextlib.suppress(Exception):
                report(sample())

    t = threading.Thread(target=loop, name="npusnap-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        with contextlib.suppress(Exception):
            report(sample())


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


def _versions(binary: criu.CriuBinary, hello: dict[int, dict[str, Any]]) -> img.Versions:
    cann: Optional[str] = None
    simulated = False
    for info in hello.values():
        a = info.get("acl") or {}
        if a.get("cann_version"):
            cann = str(a["cann_version"])
        if a.get("library"):
            version, simulated = acl.read_version_info(acl.home_of_library(str(a["library"])))
            cann = cann or version
            break
    home: Optional[str] = None
    for info in hello.values():
        library = (info.get("acl") or {}).get("library")
        if library:
            home = acl.home_of_library(str(library))
            break
    return img.Versions(
        tool=__version__,
        criu=binary.version,
        cann=cann,
        cann_simulated=simulated,
        python=sys.version.split()[0],
        cann_home=home,
    )


def _our_mount_ns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


@dataclass
class DumpState:
    """What the dump's steps share, filled in as they go (the steps are below, in order)."""

    pid: int
    final: Path
    options: DumpOptions
    cb: PipelineCallbacks
    guard: SignalGuard
    check: Optional[criu.CriuCheck]  # `criu check`, started when the dump began (None: no CRIU)
    in_job: bool  # one rank of a coordinated job dump
    # Where the image will stay once published: ``final``, or for a rank of a job dump its place
    # in the job image (``final`` is inside the job's work directory, which is renamed).
    published: Path
    start: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)  # the engine's, per step
    leftovers: tuple[str, ...] = ()  # what the stale-temp cleanup next to DIR did
    found: Optional[_Target] = None
    criu_binary: Optional[criu.CriuBinary] = None
    external: tuple[hostres.ExternalStdio, ...] = ()  # recorded for restore
    tcp_within: bool = False  # every TCP connection of the tree has both ends in it
    pid_ns: dict[str, int] = field(default_factory=dict)  # host pid -> pid in the job's namespace
    device_view: bool = False  # the tree runs in a container of the simulated NPU (pidns.py)
    host_bytes: int = 0
    stop_guard: Optional[StopGuard] = None  # resumes the tree if npusnap dies
    tmp: Optional[Path] = None  # the image's work directory until it is published
    started: bool = False  # the work directory exists: failures from here on are enriched
    devices: Optional[DeviceGroup] = None
    hello: dict[int, dict[str, Any]] = field(default_factory=dict)
    device_memory: dict[str, Any] = field(default_factory=dict)  # the manifest's record
    device_bytes: int = 0  # from the agents' records
    locking: bool = False  # Lock was attempted: a failure from here on was rolled back
    lock_start: float = 0.0
    lock_results: dict[int, dict[str, Any]] = field(default_factory=dict)
    lock_tokens: dict[int, str] = field(default_factory=dict)
    lease: Optional[LeaseKeeper] = None  # from the lock to the kill
    hasher: Optional[StreamHasher] = None  # follows CRIU's writes
    device_hasher: Optional[FileHasher] = None  # the device-memory files
    device_writeback: Optional[WritebackFollower] = None  # while the agents write them
    # The device memory kept as chunks (devchunks.py): the agents write into memory files
    # (pid -> fd), which the writer cuts into chunks, linking those earlier images hold.
    chunked: bool = False
    device_streams: dict[int, int] = field(default_factory=dict)
    chunk_writer: Optional[devchunks.ChunkWriter] = None
    sharing: Optional[devchunks.Sharing] = None  # the earlier images chunks are linked from
    bases: dict[int, devchunks.BaseSave] = field(default_factory=dict)  # pid -> its incremental base
    incremental: dict[int, devchunks.Incremental] = field(default_factory=dict)  # what the agents left out
    # --leave-running: the job's device memory is copied after the unlock, while it runs (1; 2:
    # and at the cut as well, compared after: NPUSNAP_TEST_CHECK_CONCURRENT=1).
    concurrent: int = 0
    copy_done: bool = False
    copy_stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    criu_options: CriuOptions = field(default_factory=CriuOptions)
    criu_result: Optional[criu.DumpResult] = None
    criu_s: float = 0.0  # CRIU's own run
    criu_done: float = 0.0
    frozen_end: float = 0.0
    stopped_pids: list[int] = field(default_factory=list)  # left stopped by CRIU until the kill
    host_files: tuple[hostres.HostFile, ...] = ()  # saved while frozen
    host_nodes: tuple[hostres.HostNode, ...] = ()  # dirs and FIFOs restore needs
    manifest: Optional[img.Manifest] = None
    rolling_back: bool = False
    failure_logs: Optional[str] = None  # where the discarded image's logs were kept
    outcome: Optional[DumpOutcome] = None

    @property
    def target(self) -> _Target:
        assert self.found is not None
        return self.found

    @property
    def binary(self) -> criu.CriuBinary:
        assert self.criu_binary is not None
        return self.criu_binary

    @property
    def group(self) -> DeviceGroup:
        assert self.devices is not None
        return self.devices

    @property
    def work(self) -> Path:
        assert self.tmp is not None
        return self.tmp


# -- resolve and preflight: nothing changes yet -------------------------------------------------


# The dump's checks, in the order the dump runs them (each step below runs its share, and
# `dump --dry-run` runs them all, also after a problem). Cheap checks first: bad input must fail
# before anything touches the target. Privileges before all: as a user, root's job looks like a
# tree without an NPU process.


def _c_privileges(s: DumpState) -> str:
    preflight.require_privileges("dump")
    return "root"


def _c_directory(s: DumpState) -> str:
    img.check_dump_target(s.final, force=s.options.force)
    return f"{s.final} can be written"


def _c_signing_key(s: DumpState) -> str:
    assert s.options.sign_key is not None
    imagetrust.check_signing_key(s.options.sign_key)
    return f"{s.options.sign_key} signs"


def _c_target(s: DumpState) -> str:
    s.found = resolve_target(s.pid, attach=s.options.attach)
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
    s.external = _check_external_stdio(s.target.tree, s.options, s.cb.note)
    return f"{len(s.external)} pipe(s) for restore --pipe-to" if s.external else "nothing CRIU cannot restore"


def _c_criu(s: DumpState) -> str:
    s.criu_binary = _check_criu(s.check)
    return f"CRIU {s.binary.version}, `criu check` passed"


def _c_fds(s: DumpState) -> str:
    _check_undumpable_fds(s.target.tree, s.binary)
    return "CRIU can dump every descriptor"


def _c_tcp(s: DumpState) -> str:
    s.tcp_within = _check_tcp(s.target.tree, s.options, s.in_job, s.cb.note)
    return "connections within the tree only" if s.tcp_within else "none to outside the tree unless asked for"


def _c_namespaces(s: DumpState) -> str:
    tree = s.target.tree
    ns_map = pidns.namespace_pids(s.target.root_pid, [p.pid for p in tree])
    s.pid_ns = {str(k): v for k, v in ns_map.items()}
    s.device_view = pidns.in_device_view(s.target.root_pid)
    if s.device_view and shutil.which("nsenter") is None:
        raise PreflightError(
            f"pid {s.target.root_pid} runs in a container of the simulated NPU (`restore --device-map`) "
            "and nsenter is not installed",
            why="CRIU must run in the job's mount namespace to dump it without that namespace, "
            "which a restore could not rebuild; npusnap starts it there with nsenter",
            fix="install util-linux (apt-get install util-linux), then dump again; nothing was touched",
        )
    return ("its own pid namespace" if ns_map else "the host's pid namespace") + (
        ", in a device view (CRIU runs there)" if s.device_view else ""
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
    s.host_bytes = sum(_rss(p.pid) for p in s.target.tree)
    _check_space_and_memory(s.final, s.host_bytes, 0)
    return f"room for {human_bytes(s.host_bytes)} of host memory"


def _c_agents(s: DumpState) -> str:
    """The dry run's share of the agents: their hello, as the dump's ``hello`` step asks it."""
    _connect(s)
    try:
        _hello(s)
    finally:
        s.group.close()
    return f"{len(s.hello)} agent(s) unlocked, {human_bytes(s.device_bytes)} of device memory"


def _no_target(s: DumpState) -> Optional[str]:
    return None if s.found is not None else "needs the process tree"


def _no_criu(s: DumpState) -> Optional[str]:
    return _no_target(s) or (None if s.criu_binary is not None else "needs CRIU")


def _no_agents(s: DumpState) -> Optional[str]:
    if s.found is None:
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


def _resolve(s: DumpState) -> None:
    checks.run_in_order(INPUT_CHECKS, s)
    s.leftovers = tuple(left.message for left in img.remove_stale_temps(s.final) if left.action != "kept")
    for message in s.leftovers:
        s.cb.note(message)
    checks.run_in_order(TARGET_CHECKS, s)


def _preflight(s: DumpState) -> None:
    checks.run_in_order(PREFLIGHT_CHECKS, s)


def _attach(s: DumpState) -> None:
    checks.run_in_order(ATTACH_CHECKS[:1], s)
    s.found = attach_missing(s.target, s.cb.note)
    checks.run_in_order(ATTACH_CHECKS[1:], s)


def _without_agent(s: DumpState) -> tuple[int, ...]:
    t = s.target
    return tuple(p.pid for p in t.tree if p.uses_npu and not p.has_agent and p.pid not in t.idle)


# -- the work directory and the agents ----------------------------------------------------------


def _work_area(s: DumpState) -> None:
    # CRIU will leave the tree stopped until it is published and killed; should this process
    # die in between, the guard resumes it (and the leases roll the devices back).
    s.stop_guard = StopGuard(
        [] if s.options.leave_running else [p.pid for p in s.target.tree if p.pid not in s.target.stopped]
    )
    try:
        s.tmp = img.create_temp_image(s.final)
    except OSError as exc:
        raise ImageError(
            f"cannot create the image's work directory next to {s.final}: {exc.strerror}",
            fix="check the directory's permissions and free space",
        ) from None
    s.stop_guard.remove_on_death(s.tmp)  # a killed dump leaves no work area
    s.started = True


def _discard(s: DumpState, _err: BaseException) -> None:
    """Remove the partial image, keeping its logs elsewhere (``failure_logs``)."""
    for h in (s.hasher, s.device_hasher, s.device_writeback, s.chunk_writer):
        if h is not None:
            h.stop()
    _close_streams(s)
    if s.tmp is None:
        return
    logs = hostclean.save_failure_logs(s.tmp, "dump")
    img.remove_tree(s.tmp)
    s.failure_logs = str(logs) if logs else None


def _connect(s: DumpState) -> None:
    s.devices = DeviceGroup(
        s.target.npu_pids,
        lease_s=s.options.lease_s,
        command="dump",
        interrupted=lambda: s.guard.received is not None,
    )


def _disconnect(s: DumpState, _err: BaseException) -> None:
    # An agent serves one client: a job dump may try again at once.
    s.group.close()


def _hello(s: DumpState) -> None:
    s.hello = s.group.hello()
    # Another command's lock (a freeze, an external checkpoint, a dump in progress): refuse
    # here, having changed nothing, rather than fail at Lock.
    s.group.ensure_unlocked()
    maps = {pid: devmaps.device_memory(pid) for pid in s.target.npu_pids}
    mode = s.options.device_memory
    s.device_memory = check_device_memory(mode, s.hello, maps)
    if mode == "preserve":
        s.device_bytes = sum(agent_device_bytes(h) for h in s.hello.values())
    # Host memory for the device memory only where a copy of it is held there (the agent
    # writes it into the image in small pieces by default).
    in_process = mode == "preserve" and _device_memory_in_process()
    _check_space_and_memory(s.final, s.host_bytes + s.device_bytes, s.device_bytes if in_process else 0)
    # NPUSNAP_DEVMEM_FLAT=1: one file per process, as images before chunks (benchmarks compare).
    flat = os.environ.get("NPUSNAP_DEVMEM_FLAT") == "1"
    s.chunked = mode == "preserve" and not in_process and not flat and bool(s.device_bytes)
    avail = _mem_available()
    if s.chunked and avail is not None and avail - s.device_bytes < CHUNK_STAGING_RESERVE:
        s.chunked = False
        s.cb.note(
            f"device memory written as one full file per process, not as chunks shared with "
            f"earlier images: {human_bytes(s.device_bytes)} of device memory would not fit in "
            f"the host's {human_bytes(avail)} of available memory while it is cut into chunks"
        )
    if mode == "discard":
        s.cb.note(
            "--device-memory discard: the job's device memory is NOT kept; a restore of this "
            "image brings it back with its device memory lost"
        )


# -- lock + backup ------------------------------------------------------------------------------


def _lock(s: DumpState) -> None:
    """Lock and back up every NPU process; all or nothing (DeviceGroup rolls back by itself)."""
    # The lock phase waits for the agents (they copy the device memory): meanwhile, import
    # what the CRIU step needs.
    threading.Thread(target=criu.preload, name="npusnap-preload", daemon=True).start()
    s.locking = True
    # A note a `thaw --force` left for a dead command of this pid is not about this dump's lock.
    forget_taken_over(s.target.npu_pids, os.getpid())
    # The files first, while the job still runs: reserving their room takes time with the size.
    files = _open_device_memory_files(s)
    s.lock_start = time.monotonic()
    try:
        # Ranks of one job all-reduce: one rank's collective waits for another's launch,
        # which that rank's lock holds, so the drain after Lock may not finish. Several
        # processes (a tree, or a rank of a job dump): a shorter drain, and a few more
        # tries (this pipeline's processes rolled back in between).
        several = len(s.target.npu_pids) > 1 or s.in_job
        o = s.options
        with _backup_progress(s):
            results = s.group.lock_and_backup(
                backup=True,
                device_memory=o.device_memory,
                device_memory_files=files,
                drain_timeout_s=o.drain_timeout_s or (DRAIN_TIMEOUT_GROUP_S if several else None),
                busy_retries=o.busy_retries
                if o.busy_retries is not None
                else (BUSY_RETRIES_GROUP if several else BUSY_RETRIES),
                before_retry=lambda: _empty_files(files),
                since={pid: b.save_id for pid, b in s.bases.items()},
                check_writes=os.environ.get("NPUSNAP_TEST_CHECK_WRITES") == "1",
                concurrent=s.concurrent,
            )
    finally:
        for fd, _name in files.values():
            os.close(fd)
    s.lock_tokens = s.group.tokens()
    s.lock_results = results
    _incremental(s, results)
    _drop_unused_device_memory_files(s, results)
    _hash_device_files(s, criu_done=False)


def _announce_rollback(s: DumpState) -> None:
    if not s.rolling_back:
        s.rolling_back = True
        s.cb.phase("rollback")


def _roll_back_devices(s: DumpState, err: BaseException) -> None:
    """Every locked process back to RUNNING; StateUnknownError (carrying ``err``) if not."""
    if isinstance(err, StateUnknownError):
        return  # nothing is known well enough to act on: the error says how to recover
    _announce_rollback(s)
    if s.lease is not None and s.lease.gave_up(err):
        return  # the leases rolled our locks back; no longer ours to touch (leasekeeper.py)
    group = s.group
    try:
        group.close()
        try:
            group.rollback(owned_only=True)
        finally:
            group.close()  # an agent serves one client: a job dump may try again at once
    except StateUnknownError as unknown:
        unknown.details["original_error"] = _describe(err)
        if s.tmp is not None:
            unknown.details["partial_image_removed"] = str(s.tmp)
        raise
    except NpusnapError as other:
        npu = s.target.npu_pids
        recovery = [f"npusnap status {p}" for p in npu] + [f"npusnap thaw {p}" for p in npu]
        raise StateUnknownError(
            f"rollback failed after: {_describe(err)}",
            why=other.message,
            fix="a human must look: " + " && ".join(f"npusnap status {p} && npusnap thaw {p}" for p in npu),
            details={
                "original_error": _describe(err),
                "recovery_commands": recovery,
            },
        ) from other


def _written_bytes(st: os.stat_result) -> int:
    """What a file holds so far: a file sized up front (ftruncate) has only its written blocks."""
    return min(st.st_size, st.st_blocks * 512)


@contextlib.contextmanager
def _backup_progress(s: DumpState) -> Iterator[None]:
    """Bytes backed up, as the growth of the NPU processes' host memory (Backup copies into it)."""
    if not s.device_bytes:
        yield
        return
    pids = s.target.npu_pids
    before = sum(_rss(p) for p in pids)
    total = s.device_bytes

    def report(n: int) -> None:
        s.cb.progress("device memory copy", min(total, max(0, n)), total)

    def written() -> int:
        # The agents copy into the image's device-memory files when they have them (their host
        # memory does not grow then): those files' sizes are the progress.
        d = s.tmp / img.DEVICE_SUBDIR if s.tmp is not None else None
        if d is None:
            return 0
        try:
            return sum(_written_bytes(e.stat(follow_symlinks=False)) for e in os.scandir(d) if e.is_file())
        except OSError:
            return 0

    with _sampling(lambda: max(sum(_rss(p) for p in pids) - before, written()), report):
        yield


def _open_device_memory_files(s: DumpState) -> dict[int, tuple[int, str]]:
    """In ``preserve`` mode, a file of the image per NPU process whose agent keeps device
    memory: the agent writes its copy there (after Lock) instead of into the process's
    memory, so CRIU saves and restores that much less and the bytes are written once."""
    if s.options.device_memory != "preserve" or _device_memory_in_process():
        return {}
    tmp = s.work
    files: dict[int, tuple[int, str]] = {}
    if s.chunked:
        s.sharing = devchunks.Sharing(s.published, s.options.parent)
        if s.options.leave_running and os.environ.get("NPUSNAP_NO_CONCURRENT") != "1":
            s.concurrent = 2 if os.environ.get("NPUSNAP_TEST_CHECK_CONCURRENT") == "1" else 1
        if os.environ.get("NPUSNAP_NO_INCREMENTAL") != "1":
            s.bases = _bases(s.sharing, s.hello)
    try:
        for pid, h in sorted(s.hello.items()):
            dm = h.get("device_memory") or {}
            if not dm.get("available") or not int(dm.get("allocations") or 0):
                continue
            rel = img.device_memory_rel(pid)
            path = tmp / rel
            path.parent.mkdir(mode=img.DIR_MODE, exist_ok=True)
            if s.chunked:
                # A memory file: only the pieces no earlier image holds reach the disk.
                fd = os.memfd_create(f"npusnap-devmem-{pid}", os.MFD_CLOEXEC)
                s.device_streams[pid] = os.dup(fd)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, img.FILE_MODE)
            # The agent records where the file will be once published, for a reload without
            # a descriptor (a lease's rollback after an interrupted restore): never a work
            # directory, which is gone by then.
            files[pid] = (fd, os.path.abspath(s.published / (devchunks.index_rel(pid) if s.chunked else rel)))
            try:
                streamhash.reserve(fd, _device_memory_file_size(dm))
            except OSError as nospace:
                raise OSError(nospace.errno, nospace.strerror, str(path)) from None
    except OSError as exc:
        for fd, _name in files.values():
            os.close(fd)
        _close_streams(s)
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ImageError(
            f"cannot create the device-memory file {exc.filename}: {exc.strerror}",
            why="the disk filled up since preflight" if full else "",
            fix="free space where the image is written (or write it elsewhere) and dump again; "
            "nothing was locked, the job runs on",
        ) from None
    if files and not s.chunked:
        # The agents write them with several threads, a chunk at a time at its place: the disk
        # starts on them meanwhile, and they are hashed once the lock answered
        # (_hash_device_files).
        s.device_writeback = WritebackFollower(tmp / img.DEVICE_SUBDIR).start()
    return files


def _bases(sharing: devchunks.Sharing, hello: dict[int, dict[str, Any]]) -> dict[int, devchunks.BaseSave]:
    """pid -> the newest earlier image holding a save its agent still knows (the base of an
    incremental save: only what the job wrote since is copied)."""
    bases = {}
    for pid, h in sorted(hello.items()):
        tracking = (h.get("device_memory") or {}).get("tracking") or {}
        lineage = [
            (str(i), int(e))
            for i, e in (tracking.get("lineage") or [])
            if isinstance(i, str) and isinstance(e, int)
        ]
        if lineage and not tracking.get("untracked"):
            base = devchunks.find_base(sharing, lineage)
            if base is not None:
                bases[pid] = base
    return bases


def _incremental(s: DumpState, results: dict[int, dict[str, Any]]) -> None:
    """What each agent left out of its save (since its base), for the chunk writer."""
    check = os.environ.get("NPUSNAP_TEST_CHECK_WRITES") == "1"
    for pid, base in s.bases.items():
        save = (((results.get(pid) or {}).get("device_memory") or {}).get("tracking") or {}).get("save") or {}
        if save.get("since_used") and isinstance(save.get("unchanged"), str):
            s.incremental[pid] = devchunks.Incremental(base, bytes.fromhex(save["unchanged"]), check)


def _close_streams(s: DumpState) -> None:
    for fd in s.device_streams.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    s.device_streams = {}


def _hash_device_files(s: DumpState, *, criu_done: bool) -> None:
    """Hash the device-memory files the agents wrote (the lock answered): alongside CRIU's dump
    of the host side, on one core, where cores are to spare (HASH_ALONGSIDE_CRIU_CORES); on
    every core once CRIU is done and the job stays stopped. Chunked: cut the memory files into
    chunks (on every core once CRIU is done)."""
    if s.chunked:
        if s.concurrent and not s.copy_done:
            return  # the agents copy after the unlock
        if (
            s.chunk_writer is None
            and s.device_streams
            and (criu_done or digest.usable_cores() >= HASH_ALONGSIDE_CRIU_CORES)
        ):
            sharing = s.sharing or devchunks.Sharing(s.published, s.options.parent)
            streams, s.device_streams = s.device_streams, {}
            s.chunk_writer = devchunks.ChunkWriter(
                s.work, sharing, streams, threads=digest.usable_cores(), incremental=s.incremental
            ).start()
        return
    if not criu_done and s.device_writeback is not None:
        s.device_writeback.finish()  # stopped for good (joined) at publish or rollback
    if s.device_hasher is None:
        if not criu_done and digest.usable_cores() < HASH_ALONGSIDE_CRIU_CORES:
            return
        if not (s.work / img.DEVICE_SUBDIR).is_dir():
            return
        s.device_hasher = FileHasher(s.work / img.DEVICE_SUBDIR)
        if criu_done and not s.options.leave_running:
            s.device_hasher.boost()
        s.device_hasher.start()
    elif criu_done and not s.options.leave_running:
        s.device_hasher.boost()  # the job stays stopped from here on: its cores are free


def _drop_unused_device_memory_files(s: DumpState, results: dict[int, dict[str, Any]]) -> None:
    """Remove the files an agent did not use (the driver-backed flow kept the memory)."""
    for pid in sorted(results):
        path = s.work / img.device_memory_rel(pid)
        dm = results[pid].get("device_memory") or {}
        if int(dm.get("file_bytes") or 0):
            continue
        if path.exists():
            path.unlink()
        fd = s.device_streams.pop(pid, None)
        if fd is not None:
            os.close(fd)


# -- CRIU -----------------------------------------------------------------------------------------


def _criu(s: DumpState) -> None:
    try:
        _criu_dump(s)
    except BaseException as exc:
        _resume(s, exc)  # a step that fails cleans up after itself: CRIU may have stopped the tree
        raise


def _criu_dump(s: DumpState) -> None:
    s.group.close()  # CRIU refuses connected stream sockets whose peer is outside the tree
    # Knows, until the kill, whether every lock is still the dump's (leasekeeper.py).
    lease = s.lease = LeaseKeeper(s.lock_tokens, s.options.lease_s)
    lease.renew_or_fail("before CRIU started")
    tmp = s.work
    s.criu_options = s.options.criu_for(s.target.tree, s.tcp_within)
    expected = sum(_rss(p.pid) for p in s.target.tree)
    # Checksums are computed while CRIU writes, off the critical path (streamhash.py).
    hasher = s.hasher = StreamHasher(img.criu_dir(tmp)).start()
    try:
        start = time.monotonic()
        with (
            keeping(lease, [p.pid for p in s.target.tree]),
            _sampling(
                lambda: img.tree_size(img.criu_dir(tmp)),
                lambda n: s.cb.progress("writing image", n, max(expected, n)),
            ),
        ):
            s.criu_result = criu.dump(
                s.target.root_pid,
                str(img.criu_dir(tmp)),
                str(img.logs_dir(tmp)),
                options=s.criu_options,
                log_name=img.DUMP_LOG,
                binary=s.binary,
                on_notify=lambda script, pid: _on_criu_notify(s, script, pid),
                in_mount_ns=s.device_view,
            )
        s.criu_s = time.monotonic() - start
    except OSError as exc:
        hasher.stop()
        raise ImageError(
            f"CRIU could not be started, or a file of the image could not be written: {exc}"
        ) from None
    except BaseException:
        hasher.stop()
        lease.check("while CRIU ran")  # a lost lock is the cause to report
        raise
    s.criu_done = s.frozen_end = time.monotonic()
    _hash_device_files(s, criu_done=True)
    if not s.options.leave_running:
        # The tree is stopped (leave_stopped): it is killed only after the image is published.
        s.stopped_pids = proctree.tree_pids(s.target.root_pid)
    try:
        # After stopped_pids: a refused dump's rollback must resume the stopped tree first
        # (its agents cannot answer the unlock while CRIU's SIGSTOP holds them).
        lease.check("before CRIU froze the tree")
        _check_plugin_marks(s, tmp)
        _match_dumped_tree(s)
        _check_still_idle(s)
    except BaseException:
        hasher.stop()
        raise


def _check_still_idle(s: DumpState) -> None:
    """The processes dumped without their agent (stopped, or not listening) still never opened a
    device now that CRIU has them: one resumed and opened one meanwhile would be restored with
    device state nothing saved."""
    alive = [p for p in s.target.idle if os.path.exists(f"/proc/{p}")]
    opened = [p for p in alive if not agentrecord.never_opened_a_device(p)]
    if opened:
        raise TargetError(
            f"pid(s) {opened} opened an NPU device while the dump ran; nothing was kept",
            why="they were stopped (or their agent did not listen) and had never opened a device when "
            "the dump began, so their agents were not asked; one ran meanwhile and opened one",
            fix="dump again (the job runs on)",
            details={"opened": opened},
        )


def _match_dumped_tree(s: DumpState) -> None:
    """The manifest describes exactly the processes CRIU dumped (its ``pstree.img``), which
    restore checks: the tree was read before the lock, and a child may have been forked or may
    have exited (and been reaped) since. Read again then: unless --leave-running, it is still
    stopped as CRIU saw it."""
    entries = img.read_pstree(img.criu_dir(s.work))
    if entries is None:
        return  # not CRIU's doing: publishing's verification refuses the image
    dumped = {e.pid for e in entries}
    root = s.target.root_pid

    def ids(tree: tuple[ProcInfo, ...], ns: dict[int, int]) -> dict[int, ProcInfo]:
        return {(ns[p.pid] if ns else p.pid): p for p in tree if not ns or p.pid in ns}

    if set(ids(s.target.tree, {int(k): v for k, v in s.pid_ns.items()})) == dumped:
        return
    tree = tuple(proctree.process_tree(root))
    ns = pidns.namespace_pids(root, [p.pid for p in tree])
    now = ids(tree, ns)
    kept = tuple(p for i, p in now.items() if i in dumped)  # in the tree's order
    new_npu = [p.pid for p in kept if p.uses_npu and p.pid not in s.target.npu_pids + s.target.idle]
    missing = sorted(dumped - set(now))
    if missing or new_npu:
        changes = [f"pid(s) {missing} that CRIU dumped exited"] if missing else []
        changes += [f"new NPU process(es) {new_npu} were not locked"] if new_npu else []
        raise TargetError(
            f"the tree of pid {root} changed during the dump: {'; '.join(changes)}",
            why="processes were started or ended while the job was being locked and dumped; the "
            "image would not describe what CRIU saved",
            fix="dump again (nothing was kept; the job runs on)",
            details={"criu_pids": sorted(dumped), "exited": missing, "new_npu_pids": new_npu},
        )
    s.found = replace(s.target, tree=kept)
    pids = {p.pid for p in kept}
    s.pid_ns = {str(k): v for k, v in ns.items() if k in pids}


def _resume(s: DumpState, err: BaseException) -> None:
    """The host side of the rollback: the stopped tree runs again, CRIU's leftovers go."""
    if isinstance(err, StateUnknownError):
        return
    _announce_rollback(s)
    if s.stopped_pids and s.criu_options.tcp_established:
        # CRIU keeps a stopped tree's connections locked (repair mode, nftables): undo it first.
        for problem in tcpunlock.release(s.stopped_pids, s.options.criu.network_lock):
            s.cb.note(f"rollback: {problem}")
    if s.stopped_pids:  # not those stopped before the dump: CRIU kept them stopped
        proctree.signal_tree([p for p in s.stopped_pids if p not in s.target.stopped], signal.SIGCONT)
    hostres.drop_remaps(s.host_files)


def _on_criu_notify(s: DumpState, script: str, _pid: Optional[int]) -> None:
    """At post-dump every task is still frozen: copy the tmpfs files it uses, consistently,
    and CRIU's link-remap files (CRIU deletes those after a --leave-running dump)."""
    if script != "post-dump":
        return
    tmp = s.work
    pids = [p.pid for p in s.target.tree if not p.zombie]
    paths = _host_file_paths(pids, s.options.criu.file_locks)
    if paths:
        s.cb.note(f"saving {len(paths)} tmpfs file(s) the job uses: {', '.join(paths[:3])}")
    saved = hostres.save_files(paths, tmp)
    # CRIU names them from the root of the tree's mount namespace: the host's paths only
    # when it is ours (a container's go with its runtime's checkpoint instead).
    ours = _our_mount_ns(s.target.root_pid) or s.device_view
    remaps = hostres.link_remaps(img.criu_dir(tmp)) if ours else []
    if remaps:
        s.cb.note(f"saving {len(remaps)} deleted file(s) the job has open (CRIU's link-remap files)")
    s.host_files = saved + hostres.save_files(remaps, tmp, remap=True)
    if ours:
        s.host_nodes = tuple(hostres.find_host_nodes(pids, paths))


def _visible_devices(hello: Optional[dict[str, Any]]) -> Optional[str]:
    acl = (hello or {}).get("acl")
    value = acl.get("visible_devices") if isinstance(acl, dict) else None
    return value if isinstance(value, str) else None


def _devices(s: DumpState, pid: int) -> list[int]:
    """The devices a process has open: the runtime's own word first (npusnap's LOCK_PRE
    callback, once per open device), then what the agent saw (aclrtSetDevice followed)."""
    from_callbacks = [int(d) for d in (s.lock_results.get(pid) or {}).get("callback_devices") or []]
    acl_info = (s.hello.get(pid) or {}).get("acl") or {}
    return from_callbacks or [int(d) for d in acl_info.get("devices") or []]


def _check_plugin_marks(s: DumpState, tmp: Path) -> None:
    """A dump that went through a device plugin is good only without its error line in CRIU's
    log and with its device images (what Huawei's orchestrator checks): Huawei's for Ascend
    device files, npusim_plugin.so's (one image per daemon connection) for the simulated NPU."""
    log = img.logs_dir(tmp) / img.DUMP_LOG
    problems: list[str] = []
    if any(p.device_files for p in s.target.tree):
        problems += criuplugin.scan_dump(log if log.exists() else None, img.criu_dir(tmp))
    sim = _simulated_npu_pids(s.target.tree)
    if sim:
        # A process holds a daemon connection once it opened a device.
        handles = sum(1 for pid in sim if _devices(s, pid))
        problems += criuplugin.scan_dump(
            log if log.exists() else None, img.criu_dir(tmp), criuplugin.SIMULATED, handles
        )
    if problems:
        raise CriuError(
            f"CRIU's NPU plugin did not dump the device handles cleanly: {problems[0]}",
            why="; ".join(problems),
            fix=f"read {log} (the plugin's lines); check the plugin matches this CRIU (`npusnap check`)",
            details={"problems": problems, "criu_log": str(log)},
        )


# -- unlock (--leave-running), publish, the original killed ---------------------------------------


def _unlock(s: DumpState) -> None:
    s.group.reconnect()
    try:
        if s.concurrent:
            _unlock_and_copy(s)
        else:
            s.group.unlock()
            s.frozen_end = time.monotonic()
    finally:
        s.group.close()


# The concurrent copy runs at the device's copy speed, the job's writes helping; beyond this the
# dump gives up (the job runs on, no image is kept).
COPY_DEADLINE_S = 1800.0
POISON = 0xA5


def _unlock_and_copy(s: DumpState) -> None:
    """Unlock, the agents copying the device memory into the memory files while the job runs
    (a piece it is about to write first); wait for them. Checked (``concurrent == 2``): the copy
    goes to a memory file of its own, poisoned, and is compared with the cut's copy."""
    targets = {pid: fd for pid, fd in s.device_streams.items() if pid in s.lock_results}
    reference: dict[int, int] = {}
    if s.concurrent == 2:
        for pid, fd in list(targets.items()):
            size = os.fstat(fd).st_size
            fresh = os.memfd_create(f"npusnap-devmem-check-{pid}", os.MFD_CLOEXEC)
            os.pwrite(fresh, bytes([POISON]) * size, 0)
            os.pwrite(fresh, os.pread(fd, _meta_size(fd), 0), 0)
            reference[pid], targets[pid] = fd, fresh
    try:
        # (The name is the published index's, as at the lock: the agent keeps no file by it.)
        names = {
            pid: (fd, os.path.abspath(s.published / devchunks.index_rel(pid))) for pid, fd in targets.items()
        }
        s.group.unlock(device_memory_files=names)
        s.frozen_end = time.monotonic()
        s.cb.phase("device copy")
        s.copy_stats = s.group.copy_wait(set(names), COPY_DEADLINE_S)
        left = {pid: r.get("left") for pid, r in s.copy_stats.items() if not r.get("complete")}
        if left:
            raise DeviceError(
                f"the concurrent copy of the device memory did not end within {COPY_DEADLINE_S:.0f} s",
                why=f"pieces left per pid: {left}",
                fix="the job runs on; dump again (NPUSNAP_NO_CONCURRENT=1 copies while the job is held)",
            )
        for pid, ref in reference.items():
            _compare_concurrent(pid, ref, targets[pid], s.copy_stats.get(pid) or {})
        s.copy_done = True
    finally:
        for pid in reference:
            os.close(targets[pid])


def _meta_size(fd: int) -> int:
    head = os.pread(fd, contract.DEVMEM_FILE_HEADER.size, 0)
    _magic, count, _total = contract.DEVMEM_FILE_HEADER.unpack_from(head, 0)
    return int(contract.DEVMEM_FILE_HEADER.size + count * contract.DEVMEM_FILE_RECORD.size)


def _compare_concurrent(pid: int, reference: int, copied: int, stats: dict[str, Any]) -> None:
    """The test of the concurrent copy: each piece it copied (not left poisoned) equals the cut's
    copy bit for bit, and it copied as many as it says."""
    size = os.fstat(reference).st_size
    if not size:
        return
    with (
        mmap.mmap(reference, size, prot=mmap.PROT_READ) as a,
        mmap.mmap(copied, size, prot=mmap.PROT_READ) as b,
    ):
        with memoryview(a) as va:
            pieces = devchunks.cut(va)[1:]
        copied_pieces = 0
        for off, n in pieces:
            piece = b[off : off + n]
            if piece == bytes([POISON]) * n:
                continue
            copied_pieces += 1
            if a[off : off + n] != piece:
                raise DeviceError(
                    f"the concurrent copy of pid {pid}'s device memory differs from the cut at offset {off}",
                    why="a write of the job reached a piece before it was copied",
                    fix="report this with the job's calls; dump with NPUSNAP_NO_CONCURRENT=1 meanwhile",
                )
    said = int(stats.get("cow_pieces") or 0) + int(stats.get("background_pieces") or 0)
    if copied_pieces != said:
        raise DeviceError(
            f"the concurrent copy of pid {pid} wrote {copied_pieces} pieces and says {said}",
            fix="report this; dump with NPUSNAP_NO_CONCURRENT=1 meanwhile",
        )


@contextlib.contextmanager
def _writing(s: DumpState) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise ImageError(
            f"writing the image failed: {exc.strerror or exc}",
            why="the disk is full or the filesystem refused a write"
            if getattr(exc, "errno", None) in (28, 122)
            else "the filesystem refused a write",
            fix=f"free space in {s.final.parent} (or choose another place) and dump again",
            details={"errno": exc.errno, "path": getattr(exc, "filename", None)},
        ) from None


def _checksums(s: DumpState) -> None:
    """The manifest, every file hashed (CRIU's and the device memory's): after the unlock, so
    that what is left to hash no longer keeps a --leave-running job frozen. Waits here for the
    hashers (and the disk they started)."""
    tmp = s.work
    manifest = _manifest(s)
    with _writing(s):
        assert s.hasher is not None
        streamed = {f"{img.CRIU_SUBDIR}/{rel}": v for rel, v in s.hasher.finish().items()}
        if s.device_writeback is not None:
            s.device_writeback.stop()
            s.device_writeback = None
        if s.device_hasher is not None:
            hashed = s.device_hasher.finish().items()
            streamed.update({f"{img.DEVICE_SUBDIR}/{rel}": v for rel, v in hashed})
        _hash_device_files(s, criu_done=True)  # chunked: started now if not alongside CRIU
        if s.chunk_writer is not None:
            chunks = s.chunk_writer.finish()
            streamed.update(chunks.files)
            device_total, device_new = chunks.device_total, chunks.device_new
        else:
            sizes = [v[0] for rel, v in streamed.items() if rel.startswith(img.DEVICE_SUBDIR + "/")]
            device_total = device_new = sum(sizes)
        total = sum(img.tree_size(tmp / d) for d in img.CHECKSUMMED_SUBDIRS)
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            s.cb.progress("checksums", done[0], total)

        files = img.file_entries(tmp, advance, known=streamed)
    s.manifest = replace(
        manifest,
        files=files,
        bytes=replace(
            manifest.bytes,
            image_bytes=sum(f.size for f in files),
            device_total=device_total,
            device_new=device_new,
        ),
        timings=replace(manifest.timings, total_s=time.monotonic() - s.start),
    )


def _publish(s: DumpState) -> None:
    assert s.manifest is not None
    with _writing(s):
        if s.lease is not None and s.stopped_pids:
            s.lease.check_before_kill(s.stopped_pids)
        img.publish(
            s.work,
            s.final,
            s.manifest,
            force=s.options.force,
            sign_key=s.options.sign_key,
            check=lambda work: _verify_image(s, work),
        )
    s.tmp = None  # published: nothing partial left to remove


def _verify_image(s: DumpState, work: Path) -> None:
    """Before the image takes its name (and so before the original is killed): the checks
    `npusnap verify` and restore make of an image (trust, manifest, CRIU's process tree, the
    host files, every file present with its size). The checksums were computed from the bytes
    as they were written, so they are not read back. A failure is rolled back like any other:
    the job runs on and no image is left."""
    try:
        img.verify(work, checksums=False, unpublished=True)
        if not s.options.keep:
            # Only now: an image that failed keeps CRIU's log beside DIR for the report.
            img.remove_tree(img.logs_dir(work))
    except ImageError as err:
        err.message = f"the dump's image failed its own verification and was not kept: {err.message}"
        err.why = f"{err.why}; restore would refuse it, so the dump does not report success"
        err.fix = (
            "the job was rolled back and runs on; dump again, and report this (the message and "
            "the details of `--json`) if it repeats"
        )
        raise


def _stop_original(s: DumpState) -> None:
    pids = s.stopped_pids or proctree.tree_pids(s.target.root_pid)
    if s.lease is not None:
        try:
            s.lease.check_before_kill(pids)
        except NpusnapError:
            img.remove_tree(s.final)  # not an image of a locked job: never leave it
            raise
    proctree.signal_tree(pids, signal.SIGKILL)
    left = proctree.wait_gone(pids)
    s.stopped_pids = []
    if left:
        s.cb.note(f"pid(s) {left} did not exit after SIGKILL")


def _finish(s: DumpState) -> None:
    assert s.manifest is not None
    # CRIU's link-remap files leave the host once the image holds them (or the dump failed):
    # left there, a later dump whose file ids match fails on them.
    hostres.drop_remaps(s.host_files)
    publish_s = s.timings.get("checksums", 0.0) + s.timings.get("publish", 0.0)
    timings = replace(s.manifest.timings, publish_s=publish_s, total_s=time.monotonic() - s.start)
    s.outcome = DumpOutcome(
        image=str(s.final),
        manifest=replace(s.manifest, timings=timings),
        attached=s.target.attached,
        logs=str(img.logs_dir(s.final)) if s.options.keep else None,
        attach_stopped_s=s.target.attach_stopped_s,
    )


def _manifest(s: DumpState) -> img.Manifest:
    npu = set(s.target.npu_pids)
    # Recorded with --leave-running too: the image holds the agents' memory from while the
    # dump held the lock, so the restored agents still know the dump as their owner.
    processes = []
    for p in s.target.tree:
        devices: list[int] = []
        nbytes = 0
        if p.pid in npu:
            devices = _devices(s, p.pid)
            nbytes = agent_device_bytes(s.hello.get(p.pid) or {})
        socket = p.agent_socket
        if p.pid in s.target.idle and not proctree.named_after(socket, p.pid):
            socket = None  # its parent's, held by a copy that ran no fork handler (yet)
        processes.append(
            img.ProcessEntry(
                pid=p.pid,
                ppid=p.ppid,
                cmdline=tuple(p.cmdline),
                uid=p.uid if p.uid is not None else -1,
                agent=socket is not None,
                npu=p.pid in npu,
                devices=tuple(sorted(set(devices))),
                device_bytes=nbytes,
                agent_socket=socket,
                lock_token=s.lock_tokens.get(p.pid),
                visible_devices=_visible_devices(s.hello.get(p.pid)),
                zombie=p.zombie,
            )
        )
    results = s.lock_results
    # The runtime's Lock and Backup apart from npusnap's copy of the device memory, which runs
    # inside the agent's lock (or backup, in the legacy flow) and takes the seconds; an agent
    # that does not report them (an older one) has its whole lock and backup counted as such.
    lock_times = [_first(r.get("runtime_lock_s"), r.get("lock_elapsed_s")) for r in results.values()]
    copy_times = [_sum(r.get("lock_device_copy_s"), r.get("device_copy_s")) for r in results.values()]
    drain_times = [_sum(r.get("lock_drain_s"), r.get("drain_s")) for r in results.values()]
    backup_times = [
        None
        if r.get("elapsed_s") is None
        else max(0.0, float(r["elapsed_s"]) - float(r.get("device_copy_s") or 0))
        for r in results.values()
    ]
    stats = s.criu_result.stats if s.criu_result is not None else None
    us = 1e-6
    timings = img.Timings(
        preflight_s=s.timings.get("preflight", 0.0) + s.timings.get("attach", 0.0),
        lock_s=max((float(t) for t in lock_times if t is not None), default=None),
        backup_s=max((float(t) for t in backup_times if t is not None), default=None),
        device_copy_s=max((float(t) for t in copy_times if t is not None), default=None),
        drain_s=max((float(t) for t in drain_times if t is not None), default=None),
        criu_freeze_s=stats.freezing_time_us * us if stats else None,
        criu_memdump_s=stats.memdump_time_us * us if stats else None,
        criu_memwrite_s=stats.memwrite_time_us * us if stats else None,
        criu_total_s=s.criu_s,
        unlock_s=s.timings.get("unlock") if s.options.leave_running else None,
        frozen_s=s.frozen_end - s.lock_start,
        attach_stopped_s=max((t for _, t in s.target.attach_stopped_s), default=None),
    )
    page = os.sysconf("SC_PAGE_SIZE")
    return img.Manifest(
        created_at=img.now_iso(),
        versions=_versions(s.binary, s.hello),
        host=img.HostInfo.current(),
        root_pid=s.target.root_pid,
        processes=tuple(processes),
        timings=timings,
        bytes=img.ByteCounts(
            device_bytes=s.device_bytes,
            image_bytes=0,
            criu_pages_bytes=(stats.pages_written * page) if stats else 0,
        ),
        criu_options=s.criu_options.to_dict(),
        leave_running=s.options.leave_running,
        host_files=s.host_files,
        host_nodes=s.host_nodes,
        pid_ns=s.pid_ns,
        external_stdio=s.external,
        device_memory=_device_memory_record(s),
    )


def _device_memory_record(s: DumpState) -> dict[str, Any]:
    record = dict(s.device_memory)
    processes = {k: dict(v) for k, v in (record.get("processes") or {}).items()}
    for pid, r in s.lock_results.items():
        dm = r.get("device_memory") or {}
        entry = processes.setdefault(str(pid), {})
        entry["saved_bytes"] = int(dm.get("saved_bytes") or 0)
        # "driver": the runtime and driver kept it (args != NULL); "legacy": npusnap's copy
        entry["flow"] = dm.get("flow")
        if dm.get("file_bytes"):
            # the copy is this file (or this index of chunks), not process memory
            entry["file"] = devchunks.index_rel(pid) if s.chunked else img.device_memory_rel(pid)
            save = (dm.get("tracking") or {}).get("save") or {}
            if s.chunked and isinstance(save.get("id"), str) and isinstance(save.get("epoch"), int):
                # an incremental save of this process's later dump may start from this one
                entry["save"] = {"id": save["id"], "epoch": save["epoch"]}
                if pid in s.incremental:
                    entry["base"] = s.incremental[pid].base.image.name
        stats = s.copy_stats.get(pid)
        if stats:
            # copied after the unlock while the job ran: pieces copied first for a write of the
            # job, and in the background
            entry["concurrent"] = {
                "cow_pieces": int(stats.get("cow_pieces") or 0),
                "background_pieces": int(stats.get("background_pieces") or 0),
            }
        if dm.get("fallback"):
            entry["fallback"] = dm["fallback"]
    record["processes"] = processes
    return record


# -- a failure on its way out --------------------------------------------------------------------


def _failed(s: DumpState, err: NpusnapError, undone: bool) -> NpusnapError:
    """Say where the discarded image's logs went and what runs now (every undo has run)."""
    if not s.started:
        return err  # nothing was changed
    logs = s.failure_logs
    if logs:
        old = err.details.get("criu_log")
        if isinstance(old, str):
            err.details["criu_log"] = str(Path(logs) / Path(old).name)
            err.fix = err.fix.replace(old, err.details["criu_log"])
        err.details["logs"] = logs
    err.details["partial_image_removed"] = True
    if undone and s.locking:
        npu = s.target.npu_pids
        # Never "is running" for a process that died meanwhile (killed during the dump).
        gone = [p for p in npu if not procfs.is_alive(p)]
        err.details["rolled_back"] = [p for p in npu if p not in gone]
        if gone:
            err.details["exited"] = gone
            if len(gone) == len(npu):
                err.message += f" (pid(s) {gone} exited during the dump: nothing is left running)"
            else:
                err.message += f" (pid(s) {gone} exited during the dump; the others were rolled back)"
        elif "rolled back" not in err.message:
            err.message += " (every process was rolled back and is running)"
    return err


def _describe(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return describe(err)


NOTHING_CHANGED = ("before anything was changed", "nothing was changed")
NOTHING_LOCKED = ("before anything was locked", "nothing was locked")
UNPUBLISHED = ("before the image was published", "rolled back")


def _running_on(s: DumpState) -> bool:
    return s.options.leave_running


def _killed(s: DumpState) -> bool:
    return not s.options.leave_running


# design.md §3, in order. The undo of each step is the rollback of what it did; the engine runs
# them in reverse: the stopped tree resumed, the devices rolled back, the work directory removed.
STEPS: list[Step[DumpState]] = [
    Step("resolve", _resolve, phase="resolve", checkpoint=NOTHING_CHANGED),
    Step("preflight", _preflight, phase="preflight", checkpoint=NOTHING_CHANGED),
    Step("attach", _attach, checkpoint=NOTHING_LOCKED, barrier="preflight"),
    Step("work area", _work_area, undo=_discard, checkpoint=NOTHING_LOCKED),
    Step("connect", _connect, undo=_disconnect, checkpoint=NOTHING_LOCKED),
    Step("hello", _hello, checkpoint=NOTHING_LOCKED),
    Step("lock+backup", _lock, undo=_roll_back_devices, phase="lock+backup", barrier="backup"),
    Step(
        "criu",
        _criu,
        undo=_resume,
        phase="criu dump",
        barrier="criu",
        checkpoint=("during the CRIU dump", "rolled back"),
    ),
    Step("unlock", _unlock, phase="unlock", when=_running_on, checkpoint=UNPUBLISHED),
    Step("checksums", _checksums, phase="publish", checkpoint=UNPUBLISHED),
    # A job commits at its "publish" barrier: the originals are killed only after that. From here
    # on a signal no longer throws the image away; a failure still rolls everything back.
    Step("publish", _publish, barrier="publish", finishing=True),
    Step("stop original", _stop_original, phase="stop original", when=_killed, commit=True),
    Step("finish", _finish, commit=True),
]


@dataclass(frozen=True)
class DryRunOutcome:
    """What `dump --dry-run` found: every check's result (nothing was touched)."""

    image: str
    results: tuple[checks.CheckResult, ...]
    pids: tuple[int, ...]
    npu_pids: tuple[int, ...]
    would_attach: tuple[int, ...]

    @property
    def exit_code(self) -> int:
        return checks.first_problem(self.results)

    def to_dict(self) -> dict[str, object]:
        return {
            "image": self.image,
            "ready": self.exit_code == 0,
            "checks": [r.to_dict() for r in self.results],
            "pids": list(self.pids),
            "npu_pids": list(self.npu_pids),
            "would_attach": list(self.would_attach),
        }


def dry_run(
    pid: int, directory: Path, options: DumpOptions, callbacks: DumpCallbacks = DumpCallbacks()
) -> DryRunOutcome:
    """Every check of a dump of ``pid`` into ``directory`` (``CHECKS``), also after a problem,
    touching nothing: no stale work area removed, no agent attached (a process without one is
    what the dump would attach to; the agents' check then does not apply), no lock, no freeze."""
    final = Path(os.path.abspath(directory))
    try:
        check: Optional[criu.CriuCheck] = criu.CriuCheck(criu.find_criu())
    except NpusnapError:
        check = None
    try:
        # No handlers installed: nothing is held, so Ctrl-C may stop the dry run anywhere.
        state = DumpState(
            pid=pid,
            final=final,
            options=options,
            cb=callbacks,
            guard=SignalGuard(callbacks.note),
            check=check,
            in_job=False,
            start=time.monotonic(),
            published=final,
        )
        results = checks.run_all(CHECKS, state)
    finally:
        if check is not None:
            check.cancel()
    tree = state.found.tree if state.found is not None else ()
    return DryRunOutcome(
        image=str(final),
        results=tuple(results),
        pids=tuple(p.pid for p in tree),
        npu_pids=state.found.npu_pids if state.found is not None else (),
        would_attach=_without_agent(state) if state.found is not None else (),
    )


def dump(
    pid: int,
    directory: Path,
    options: DumpOptions = DumpOptions(),
    callbacks: DumpCallbacks = DumpCallbacks(),
    coordinator: Optional[Barrier] = None,
    published: Optional[Path] = None,
) -> DumpOutcome:
    """Run the whole dump pipeline (see the module docstring); raise NpusnapError on failure.

    ``coordinator`` (jobsnap.JobCoordinator) makes this one rank of a coordinated job dump: its
    ``sync(phase)`` blocks at each phase boundary until every rank got there, and raises an
    NpusnapError (this rank then rolls back like any failure) when another rank failed.
    ``published``: where DIRECTORY will be once the caller has published it (a rank's image
    inside a job's work directory), if not DIRECTORY itself.
    """
    final = Path(os.path.abspath(directory))
    start = time.monotonic()
    # `criu check` runs while the target is resolved and checked; preflight reads its answer.
    # Without a usable CRIU, preflight says so in its turn (after the checks of the input).
    try:
        check: Optional[criu.CriuCheck] = criu.CriuCheck(criu.find_criu())
    except NpusnapError:
        check = None
    try:
        with SignalGuard(callbacks.note) as guard:
            state = DumpState(
                pid=pid,
                final=final,
                options=options,
                cb=callbacks,
                guard=guard,
                check=check,
                in_job=coordinator is not None,
                start=start,
                published=Path(os.path.abspath(published or directory)),
            )
            pipeline = Pipeline(
                "dump",
                STEPS,
                cb=callbacks,
                guard=guard,
                barrier=coordinator,
                on_failure=_failed,
                timings=state.timings,
            )
            try:
                pipeline.run(state)
            finally:
                if state.stop_guard is not None:
                    state.stop_guard.finish()
    finally:
        if check is not None:
            check.cancel()  # only still running when the dump failed before preflight read it
    assert state.outcome is not None
    return replace(state.outcome, leftovers=state.leftovers)
