"""The dump pipeline: NPU processes locked and backed up, the tree dumped by CRIU, the image published.

design.md §3, in order:

1. resolve the tree of PID and its NPU processes (attach where an agent is missing);
2. preflight (CRIU, privileges, DIR, free space against the expected image, host RAM against
   the device bytes);
3. Lock + Backup every NPU process in parallel under a lease (``DeviceGroup``);
4. close the agent connections, CRIU dump of the whole tree into a temporary sibling of DIR;
5. publish (checksums, manifest, fsync, rename), then the original tree is killed — or, with
   ``leave_running``, every NPU process is unlocked and keeps running.

Never lose the job: CRIU dumps with ``leave_stopped`` rather than letting CRIU kill the tree, so
that the original is killed only once the image is safely on disk; until then every failure
(CRIU refused or crashed, disk full, a device call or an agent failed, Ctrl-C / SIGTERM) rolls
every locked process back to RUNNING and removes the partial image; if npusnap itself dies while
the tree is stopped, ``StopGuard``'s watcher resumes it and the leases roll it back. If the
rollback itself fails the error is ``StateUnknownError`` with the commands to inspect and recover.

Core module: returns frozen dataclasses, reports progress through ``DumpCallbacks``, never prints.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import __version__, contract
from npusnap_cli import image as img
from npusnap_cli.errors import (
    ImageError,
    NpusnapError,
    PreflightError,
    StateUnknownError,
    TargetError,
)
from npusnap_cli.host import hostclean
from npusnap_cli.pipelines.callbacks import PhaseFn, PipelineCallbacks, no_phase
from npusnap_cli.pipelines.engine import SignalGuard

DEFAULT_LEASE_S = 60.0
# Headroom on top of the expected image size: CRIU's own metadata, the manifest, filesystem slack.
SPACE_MARGIN_BYTES = 16 << 20
SPACE_MARGIN_FACTOR = 1.10
# Cores from which the device-memory files are hashed alongside CRIU's dump: one for CRIU, one for
# the hash, the rest for the disk's writeback and the kernel. With fewer they are hashed once CRIU
# is done, on every core: on 2 cores here, hashing alongside slowed CRIU, and the job stayed frozen
# longer for no shorter dump (1 GiB, 4 interleaved pairs: frozen 0.60 against 0.65 s, the whole
# dump 1.08 against 1.11 s; 4 GiB: frozen 1.50 against 1.72 s, dump 2.76 against 2.83 s).
HASH_ALONGSIDE_CRIU_CORES = 4
_POLL_S = 0.2

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
DumpCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class DumpOptions:
    """What `npusnap dump` was asked to do; CRIU/podman option names and meanings."""

    leave_running: bool = False
    tcp_established: bool = False
    shell_job: bool = False
    file_locks: bool = False
    ext_unix_sk: bool = False
    external: tuple[str, ...] = ()
    timeout: Optional[int] = None
    keep: bool = False
    force: bool = False
    attach: bool = True
    lease_s: float = DEFAULT_LEASE_S
    # Host-side resources (hostres.py / criu.CriuOptions).
    link_remap: bool = True
    network_lock: Optional[str] = None
    external_pipes: bool = False
    sign_key: Optional[Path] = None  # Ed25519 private key (PEM): sign the manifest (imagetrust)
    device_memory: str = contract.DEFAULT_DEVICE_MEMORY_MODE  # docs/device-memory.md
    # How long each agent waits for its devices to drain after Lock; None: 10 s, or
    # DRAIN_TIMEOUT_GROUP_S for a tree of several NPU processes.
    drain_timeout_s: Optional[float] = None
    # Lock attempts after a device that did not drain; None: 1, or BUSY_RETRIES_GROUP for a tree of
    # several NPU processes (a job dump sets 0 and retries all its ranks together).
    busy_retries: Optional[int] = None


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
    tree: tuple[Any, ...]  # proctree.ProcInfo, root first
    npu_pids: tuple[int, ...]
    attached: tuple[int, ...] = ()
    attach_stopped_s: tuple[tuple[int, float], ...] = ()


def resolve_target(pid: int, *, attach: bool) -> _Target:
    """The tree of ``pid`` and its NPU processes; read-only (agents are attached later).

    Raises TargetError when the pid does not exist, when no process of the tree uses the NPU,
    or when one lacks an agent and ``attach`` is false.
    """
    from npusnap_cli.host import proctree

    tree = proctree.process_tree(pid)  # TargetError when pid does not exist
    npu = [p for p in tree if p.uses_npu]
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
    if missing and not attach:
        raise TargetError(
            f"NPU process(es) without an agent: {', '.join(map(str, missing))}",
            why="their device state can only be saved from inside them, by an agent; --no-attach was given",
            fix=" ; ".join(f"npusnap attach {m}" for m in missing) + " (or drop --no-attach)",
            details={"without_agent": missing},
        )
    return _Target(root_pid=pid, tree=tuple(tree), npu_pids=tuple(p.pid for p in npu))


def attach_missing(target: _Target, note: PhaseFn = no_phase) -> _Target:
    """Inject an agent into every NPU process of ``target`` that has none; the refreshed target."""
    missing = [p.pid for p in target.tree if p.uses_npu and not p.has_agent]
    if not missing:
        return target
    from npusnap_cli.device import attach as attach_mod
    from npusnap_cli.host import proctree

    stopped: list[tuple[int, float]] = []
    for m in missing:
        note(f"pid {m} has no agent: attaching one")
        result = attach_mod.attach(m)
        if result.stopped_s is not None:
            stopped.append((m, result.stopped_s))
    tree = proctree.process_tree(target.root_pid)
    npu = [p for p in tree if p.uses_npu]
    still = [p.pid for p in npu if not p.has_agent]
    if still:
        raise TargetError(
            f"attach reported success but pid(s) {still} have no agent socket",
            why="the injected agent did not start listening",
            fix="see the target's stderr (npusnap-agent lines); try `npusnap attach PID -v`",
        )
    return _Target(
        root_pid=target.root_pid,
        tree=tuple(tree),
        npu_pids=tuple(p.pid for p in npu),
        attached=tuple(missing),
        attach_stopped_s=tuple(stopped),
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


def _check_privileges() -> None:
    from npusnap_cli.host import preflight

    problems = [i for i in preflight.check_privileges() if i.status == preflight.PROBLEM]
    if problems:
        raise PreflightError(
            f"not enough privileges to dump: {problems[0].detail}",
            why="CRIU needs root (or CAP_CHECKPOINT_RESTORE + CAP_SYS_PTRACE) to dump a process",
            fix=problems[0].fix or "run npusnap as root",
            details={"problems": [i.detail for i in problems]},
        )


def _check_other_users(tree: tuple[Any, ...]) -> None:
    from npusnap_cli.host import preflight

    problem = preflight.other_user_problem([p.uid for p in tree if p.uid is not None])
    if problem:
        raise PreflightError(
            f"cannot dump: {problem.detail}",
            why="CRIU reads every process's rlimits (prlimit), which needs CAP_SYS_RESOURCE for "
            "another user's process",
            fix=problem.fix,
        )


def _check_session(tree: tuple[Any, ...], *, shell_job: bool) -> None:
    """Refuse, before anything is locked, the two session layouts CRIU is certain to refuse."""
    from npusnap_cli.host import procfs

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


def _check_external_stdio(tree: tuple[Any, ...], options: DumpOptions, note: PhaseFn) -> tuple[Any, ...]:
    """Refuse pipes/terminals to outside the tree on stdin/out/err (the restored job would die
    of them); with --external-pipes, the pipes are recorded for `restore --pipe-to` instead."""
    from npusnap_cli.host import hostres

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
        err = hostres.external_stdio_error(ttys, shell_job=options.shell_job)
        if err is not None:
            raise err
        return tuple(e for e in found if e.kind == "pipe")
    err = hostres.external_stdio_error(found, shell_job=options.shell_job)
    if err is not None:
        raise err
    return ()


def _check_undumpable_fds(tree: tuple[Any, ...], binary: Any) -> None:
    """Refuse descriptors CRIU cannot dump (io_uring, perf events...) before anything is locked."""
    from npusnap_cli.host import preflight

    found = preflight.find_undumpable_fds([p.pid for p in tree], preflight.criu_has_libbpf(binary.path))
    err = preflight.undumpable_fds_error(found)
    if err is not None:
        raise err


def _check_criu(check: Optional[Any]) -> Any:
    """The CRIU binary of ``check`` (a criu.CriuCheck started when the dump began; None: no usable
    CRIU was found then), once its ``criu check`` passed."""
    if check is None:
        from npusnap_cli import criu

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


def _unneeded_network_lock(tree: tuple[Any, ...], tcp_established: bool) -> Optional[str]:
    """``"skip"`` where CRIU's network lock would lock nothing, so that the dump does not pay for
    it: a tree wholly in this host's network namespace is locked one TCP connection at a time,
    which only --tcp-established dumps have, yet CRIU's nftables method still creates its table up
    front (0.1 s here, a third of a small dump's CRIU time). None (CRIU's default method) for a
    tree in a network namespace of its own (CRIU locks the whole namespace) or with
    --tcp-established; a --network-lock on the command line always wins."""
    if tcp_established:
        return None
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        if all(os.stat(f"/proc/{p.pid}/ns/net").st_ino == mine for p in tree):
            return "skip"
    except OSError:
        pass
    return None


def _simulated_npu_pids(tree: tuple[Any, ...]) -> list[int]:
    """Processes of the tree that have the simulated NPU's runtime loaded (its CANN tree says
    Simulated in version.info): their device handle is a connection to the npusim daemon."""
    from npusnap_cli import acl

    homes: dict[str, bool] = {}
    pids = []
    for p in tree:
        library = getattr(p, "acl_library", None)
        if not library:
            continue
        home = _cann_home_of(str(library))
        if home not in homes:
            homes[home] = acl.read_version_info(home)[1]
        if homes[home]:
            pids.append(int(p.pid))
    return pids


def _check_npu_plugin(tree: tuple[Any, ...]) -> None:
    """Device handles need a CRIU plugin: real Ascend device files Huawei's, the simulated NPU's
    daemon connection this project's npusim_plugin.so. Missing or built for another CRIU: refused."""
    from npusnap_cli.host import criuplugin, preflight

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
    from npusnap_cli.units import human_bytes

    need = int(expected_image * SPACE_MARGIN_FACTOR) + SPACE_MARGIN_BYTES
    have = img.free_bytes(final.parent)
    if have < need:
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
    mode: str, hello: dict[int, dict[str, Any]], maps: Optional[dict[int, Any]] = None
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


@dataclass
class _Clock:
    start: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.marks[name] = time.monotonic() - t


def _cann_home_of(library: str) -> str:
    d = Path(os.path.realpath(library)).parent
    if d.name == "lib64" and d.parent.name.endswith("-linux"):
        return str(d.parent.parent)
    return str(d.parent)


def _versions(binary: Any, hello: dict[int, dict[str, Any]]) -> img.Versions:
    from npusnap_cli import acl

    cann: Optional[str] = None
    simulated = False
    for info in hello.values():
        a = info.get("acl") or {}
        if a.get("cann_version"):
            cann = str(a["cann_version"])
        if a.get("library"):
            version, simulated = acl.read_version_info(_cann_home_of(str(a["library"])))
            cann = cann or version
            break
    home: Optional[str] = None
    for info in hello.values():
        library = (info.get("acl") or {}).get("library")
        if library:
            home = str(_cann_home_of(str(library)))
            break
    return img.Versions(
        tool=__version__,
        criu=binary.version,
        cann=cann,
        cann_simulated=simulated,
        python=sys.version.split()[0],
        cann_home=home,
    )


def _tree_pids(root_pid: int) -> list[int]:
    """The tree of ``root_pid`` as it is now (children first), for the final kill."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        kids = root.children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in reversed(kids)] + [root_pid]


def _our_mount_ns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


def _signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is running (gone or a zombie); return the ones still there."""
    from npusnap_cli.host import procfs

    end = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < end:
        left = [p for p in left if procfs.is_alive(p)]
        if left:
            time.sleep(0.02)
    return left


def dump(
    pid: int,
    directory: Path,
    options: DumpOptions = DumpOptions(),
    callbacks: DumpCallbacks = DumpCallbacks(),
    coordinator: Optional[Any] = None,
) -> DumpOutcome:
    """Run the whole dump pipeline (see the module docstring); raise NpusnapError on failure.

    ``coordinator`` (jobsnap.JobCoordinator) makes this one rank of a coordinated job dump: its
    ``sync(phase)`` blocks at each phase boundary until every rank got there, and raises an
    NpusnapError (this rank then rolls back like any failure) when another rank failed.
    """
    from npusnap_cli import criu

    final = Path(os.path.abspath(directory))
    clock = _Clock()
    cb = callbacks
    # `criu check` runs while the target is resolved and checked; preflight reads its answer.
    # Without a usable CRIU, preflight says so in its turn (after the checks of the input).
    try:
        check: Optional[Any] = criu.CriuCheck(criu.find_criu())
    except NpusnapError:
        check = None
    try:
        return _dump(pid, final, options, cb, coordinator, clock, check)
    finally:
        if check is not None:
            check.cancel()  # only still running when the dump failed before preflight read it


def _dump(
    pid: int,
    final: Path,
    options: DumpOptions,
    cb: DumpCallbacks,
    coordinator: Optional[Any],
    clock: _Clock,
    check: Optional[Any],
) -> DumpOutcome:
    with SignalGuard(cb.note) as guard:
        cb.phase("resolve")
        with clock.phase("resolve"):
            # Cheap checks first: bad input must fail before anything touches the target.
            img.check_dump_target(final, force=options.force)
            if options.sign_key is not None:
                from npusnap_cli.image import imagetrust

                imagetrust.check_signing_key(options.sign_key)
            leftovers = tuple(left.message for left in img.remove_stale_temps(final) if left.action != "kept")
            for message in leftovers:
                cb.note(message)
            target = resolve_target(pid, attach=options.attach)
        cb.phase("preflight")
        with clock.phase("preflight"):
            _check_privileges()
            _check_other_users(target.tree)
            _check_session(target.tree, shell_job=options.shell_job)
            external = _check_external_stdio(target.tree, options, cb.note)
            binary = _check_criu(check)
            _check_undumpable_fds(target.tree, binary)
            from npusnap_cli.host import pidns

            ns_map = pidns.namespace_pids(target.root_pid, [p.pid for p in target.tree])
            _check_npu_plugin(target.tree)
            guard.check("before anything was changed", "nothing was changed")
            from npusnap_cli.device.devicegroup import refuse_stopped

            refuse_stopped(target.npu_pids, "dump")  # being checkpointed by someone else
            target = attach_missing(target, cb.note)
            # The host side now; the device memory once the agents said how much they hold.
            host_bytes = sum(_rss(p.pid) for p in target.tree)
            _check_space_and_memory(final, host_bytes, 0)
        guard.check("before anything was locked", "nothing was locked")
        if coordinator is not None:
            coordinator.sync("preflight")
        pipeline = _Pipeline(final, target, options, binary, host_bytes, clock, cb, guard)
        pipeline.coordinator = coordinator
        pipeline.external = external
        pipeline.pid_ns = {str(k): v for k, v in ns_map.items()}
        return replace(pipeline.run(), leftovers=leftovers)


class _Pipeline:
    def __init__(
        self,
        final: Path,
        target: _Target,
        options: DumpOptions,
        binary: Any,
        host_bytes: int,
        clock: _Clock,
        cb: DumpCallbacks,
        guard: SignalGuard,
    ) -> None:
        self.final = final
        self.target = target
        self.options = options
        self.binary = binary
        self.host_bytes = host_bytes
        self.device_bytes = 0  # from the agents' records, after hello
        self.lock_results: dict[int, dict[str, Any]] = {}
        self.clock = clock
        self.cb = cb
        self.guard = guard
        self.tmp: Optional[Path] = None
        self.group: Any = None
        self.hello: dict[int, dict[str, Any]] = {}
        self.device_memory: dict[str, Any] = {}
        self.stopped_pids: list[int] = []
        self.external: tuple[Any, ...] = ()  # hostres.ExternalStdio recorded for restore
        self.host_files: tuple[Any, ...] = ()  # hostres.HostFile saved while frozen
        self.host_nodes: tuple[Any, ...] = ()  # hostres.HostNode: dirs and FIFOs restore needs
        self.pid_ns: dict[str, int] = {}  # host pid -> pid in the job's own namespace (pidns.py)
        self.hasher: Any = None  # streamhash.StreamHasher following CRIU's writes
        self.device_hasher: Any = None  # streamhash.FileHasher of the device-memory files
        self.device_writeback: Any = None  # streamhash.WritebackFollower while the agents write them
        self.lock_tokens: dict[int, str] = {}
        self.lease: Any = None  # leasekeeper.LeaseKeeper from the lock to the kill
        self.stop_guard: Any = None  # host.stopguard.StopGuard: resumes the tree if npusnap dies
        self.coordinator: Optional[Any] = None  # jobsnap.JobCoordinator of a coordinated job dump

    def _sync(self, phase: str) -> None:
        """Job dumps: wait for every rank to finish ``phase``; raises when another rank failed."""
        if self.coordinator is not None:
            self.coordinator.sync(phase)

    # -- failure handling ---------------------------------------------------------------------
    def _rollback(self, err: BaseException) -> None:
        """Every locked process back to RUNNING; StateUnknownError (carrying ``err``) if not."""
        self.cb.phase("rollback")
        if self.stopped_pids and self.options.tcp_established:
            # CRIU keeps a stopped tree's connections locked (repair mode, nftables): undo it first.
            from npusnap_cli.host import tcpunlock

            for problem in tcpunlock.release(self.stopped_pids, self.options.network_lock):
                self.cb.note(f"rollback: {problem}")
        if self.stopped_pids:
            _signal_tree(self.stopped_pids, signal.SIGCONT)
        self._drop_remaps()
        if self.lease is not None and self.lease.gave_up(err):
            return  # the leases rolled our locks back; no longer ours to touch (leasekeeper.py)
        if self.group is None:
            return
        try:
            self.group.close()
            try:
                self.group.rollback(owned_only=True)
            finally:
                self.group.close()  # an agent serves one client: a job dump may try again at once
        except StateUnknownError as unknown:
            unknown.details["original_error"] = _describe(err)
            if self.tmp is not None:
                unknown.details["partial_image_removed"] = str(self.tmp)
            raise
        except NpusnapError as other:
            raise StateUnknownError(
                f"rollback failed after: {_describe(err)}",
                why=other.message,
                fix="a human must look: "
                + " && ".join(f"npusnap status {p} && npusnap thaw {p}" for p in self.target.npu_pids),
                details={
                    "original_error": _describe(err),
                    "recovery_commands": [f"npusnap status {p}" for p in self.target.npu_pids]
                    + [f"npusnap thaw {p}" for p in self.target.npu_pids],
                },
            ) from other

    def _drop_remaps(self) -> None:
        """CRIU's link-remap files leave the host once the image holds them, or once the dump
        failed: left there, a later dump whose file ids match fails on them."""
        from npusnap_cli.host import hostres

        hostres.drop_remaps(self.host_files)

    def _discard(self) -> Optional[str]:
        """Remove the partial image, keeping its logs elsewhere; return where they went."""
        for h in (self.hasher, self.device_hasher, self.device_writeback):
            if h is not None:
                h.stop()
        if self.tmp is None:
            return None
        logs = hostclean.save_failure_logs(self.tmp, "dump")
        img.remove_tree(self.tmp)
        return str(logs) if logs else None

    def _fail(self, err: NpusnapError, *, rolled_back: bool) -> NpusnapError:
        logs = self._discard()
        if logs:
            old = err.details.get("criu_log")
            if isinstance(old, str):
                err.details["criu_log"] = str(Path(logs) / Path(old).name)
                err.fix = err.fix.replace(old, err.details["criu_log"])
            err.details["logs"] = logs
        err.details["partial_image_removed"] = True
        if rolled_back:
            from npusnap_cli.host import procfs

            # Never "is running" for a process that died meanwhile (killed during the dump).
            gone = [p for p in self.target.npu_pids if not procfs.is_alive(p)]
            err.details["rolled_back"] = [p for p in self.target.npu_pids if p not in gone]
            if gone:
                err.details["exited"] = gone
                if len(gone) == len(self.target.npu_pids):
                    err.message += f" (pid(s) {gone} exited during the dump: nothing is left running)"
                else:
                    err.message += f" (pid(s) {gone} exited during the dump; the others were rolled back)"
            elif "rolled back" not in err.message:
                err.message += " (every process was rolled back and is running)"
        return err

    # -- the steps ----------------------------------------------------------------------------
    def run(self) -> DumpOutcome:
        from npusnap_cli.host.stopguard import StopGuard

        # CRIU will leave the tree stopped until it is published and killed; should this process
        # die in between, the guard resumes it (and the leases roll the devices back).
        guard = StopGuard([] if self.options.leave_running else [p.pid for p in self.target.tree])
        self.stop_guard = guard
        try:
            return self._run()
        finally:
            if guard is not None:
                guard.finish()

    def _run(self) -> DumpOutcome:
        from npusnap_cli.device.devicegroup import DeviceGroup
        from npusnap_cli.device.leasekeeper import LeaseKeeper

        try:
            self.tmp = img.create_temp_image(self.final)
            if self.stop_guard is not None:
                self.stop_guard.remove_on_death(self.tmp)  # a killed dump leaves no work area
        except OSError as exc:
            raise ImageError(
                f"cannot create the image's work directory next to {self.final}: {exc.strerror}",
                fix="check the directory's permissions and free space",
            ) from None
        try:
            self.group = DeviceGroup(
                self.target.npu_pids,
                lease_s=self.options.lease_s,
                command="dump",
                interrupted=lambda: self.guard.received is not None,
            )
            self.hello = self.group.hello()
            # Another command's lock (a freeze, an external checkpoint, a dump in progress): refuse
            # here, having changed nothing, rather than fail at Lock.
            self.group.ensure_unlocked()
            from npusnap_cli.host import devmaps

            maps = {pid: devmaps.device_memory(pid) for pid in self.target.npu_pids}
            self.device_memory = check_device_memory(self.options.device_memory, self.hello, maps)
            if self.options.device_memory == "preserve":
                self.device_bytes = sum(agent_device_bytes(h) for h in self.hello.values())
            # Host memory for the device memory only where a copy of it is held there (the
            # agent writes it into the image in small pieces by default).
            in_process = self.options.device_memory == "preserve" and _device_memory_in_process()
            _check_space_and_memory(
                self.final, self.host_bytes + self.device_bytes, self.device_bytes if in_process else 0
            )
        except NpusnapError as err:
            if self.group is not None:
                self.group.close()
            raise self._fail(err, rolled_back=False) from None
        if self.options.device_memory == "discard":
            self.cb.note(
                "--device-memory discard: the job's device memory is NOT kept; a restore of this "
                "image brings it back with its device memory lost"
            )

        from npusnap_cli import criu

        # The lock phase waits for the agents (they copy the device memory): meanwhile, import
        # what the CRIU step needs.
        threading.Thread(target=criu.preload, name="npusnap-preload", daemon=True).start()
        lock_start = time.monotonic()
        self.cb.phase("lock+backup")
        try:
            files = self._open_device_memory_files()
            try:
                # Ranks of one job all-reduce: one rank's collective waits for another's launch,
                # which that rank's lock holds, so the drain after Lock may not finish. Several
                # processes (a tree, or a rank of a job dump): a shorter drain, and a few more
                # tries (this pipeline's processes rolled back in between).
                several = len(self.target.npu_pids) > 1 or self.coordinator is not None
                with self.clock.phase("lock+backup"), self._backup_progress():
                    results = self.group.lock_and_backup(
                        backup=True,
                        device_memory=self.options.device_memory,
                        device_memory_files=files,
                        drain_timeout_s=self.options.drain_timeout_s
                        or (DRAIN_TIMEOUT_GROUP_S if several else None),
                        busy_retries=self.options.busy_retries
                        if self.options.busy_retries is not None
                        else (BUSY_RETRIES_GROUP if several else BUSY_RETRIES),
                        before_retry=lambda: _empty_files(files),
                    )
            finally:
                for fd, _name in files.values():
                    os.close(fd)
            self.lock_tokens = self.group.tokens()
            self.lock_results = results
            self._drop_unused_device_memory_files(results)
            self._hash_device_files(criu_done=False)
        except StateUnknownError as err:
            raise self._fail(err, rolled_back=False) from None
        except NpusnapError as err:
            # DeviceGroup rolled every process back before raising. Its connections go now: an
            # agent serves one client, and a job dump may try again at once.
            self.group.close()
            raise self._fail(err, rolled_back=True) from None
        try:
            self.guard.check("during lock+backup", "rolled back")
            self._sync("backup")
            self.group.close()  # CRIU refuses connected stream sockets whose peer is outside the tree
            # Knows, until the kill, whether every lock is still the dump's (leasekeeper.py).
            self.lease = LeaseKeeper(self.lock_tokens, self.options.lease_s)
            self.lease.renew_or_fail("before CRIU started")
            outcome = self._criu_and_publish(results, lock_start)
        except NpusnapError as err:
            if isinstance(err, StateUnknownError):
                raise self._fail(err, rolled_back=False) from None
            try:
                self._rollback(err)
            except StateUnknownError as unknown:
                raise self._fail(unknown, rolled_back=False) from None
            raise self._fail(err, rolled_back=True) from None
        except BaseException as exc:
            # A bug or KeyboardInterrupt that slipped past the guard: still never lose the job.
            try:
                self._rollback(exc)
            finally:
                self._discard()
            raise
        return outcome

    @contextlib.contextmanager
    def _backup_progress(self) -> Iterator[None]:
        """Bytes backed up, as the growth of the NPU processes' host memory (Backup copies into it)."""
        if not self.device_bytes:
            yield
            return
        pids = self.target.npu_pids
        before = sum(_rss(p) for p in pids)
        total = self.device_bytes

        def report(n: int) -> None:
            self.cb.progress("device backup", min(total, max(0, n)), total)

        with _sampling(lambda: sum(_rss(p) for p in pids) - before, report):
            yield

    def _criu_options(self) -> Any:
        from npusnap_cli import criu

        o = self.options
        return criu.CriuOptions(
            leave_running=o.leave_running,
            leave_stopped=not o.leave_running,
            tcp_established=o.tcp_established,
            shell_job=o.shell_job,
            file_locks=o.file_locks,
            ext_unix_sk=o.ext_unix_sk,
            external=o.external,
            timeout=o.timeout,
            link_remap=o.link_remap,
            network_lock=o.network_lock or _unneeded_network_lock(self.target.tree, o.tcp_established),
        )

    def _on_criu_notify(self, script: str, _pid: Optional[int]) -> None:
        """At post-dump every task is still frozen: copy the tmpfs files it uses, consistently,
        and CRIU's link-remap files (CRIU deletes those after a --leave-running dump)."""
        if script != "post-dump":
            return
        from npusnap_cli.host import hostres

        assert self.tmp is not None
        paths = hostres.find_tmpfs_files([p.pid for p in self.target.tree])
        if self.options.file_locks:  # lock files (often removed by the original when it exits)
            paths = sorted(set(paths) | set(hostres.find_locked_files([p.pid for p in self.target.tree])))
        if paths:
            self.cb.note(f"saving {len(paths)} tmpfs file(s) the job uses: {', '.join(paths[:3])}")
        saved = hostres.save_files(paths, self.tmp)
        # CRIU names them from the root of the tree's mount namespace: the host's paths only
        # when it is ours (a container's go with its runtime's checkpoint instead).
        remaps = hostres.link_remaps(img.criu_dir(self.tmp)) if _our_mount_ns(self.target.root_pid) else []
        if remaps:
            self.cb.note(f"saving {len(remaps)} deleted file(s) the job has open (CRIU's link-remap files)")
        self.host_files = saved + hostres.save_files(remaps, self.tmp, remap=True)
        if _our_mount_ns(self.target.root_pid):
            self.host_nodes = tuple(hostres.find_host_nodes([p.pid for p in self.target.tree], paths))

    def _open_device_memory_files(self) -> dict[int, tuple[int, str]]:
        """In ``preserve`` mode, a file of the image per NPU process whose agent keeps device
        memory: the agent writes its copy there (before Lock) instead of into the process's
        memory, so CRIU saves and restores that much less and the bytes are written once."""
        if self.options.device_memory != "preserve" or _device_memory_in_process():
            return {}
        from npusnap_cli.image import streamhash

        assert self.tmp is not None
        files: dict[int, tuple[int, str]] = {}
        try:
            for pid, h in sorted(self.hello.items()):
                dm = h.get("device_memory") or {}
                if not dm.get("available") or not int(dm.get("allocations") or 0):
                    continue
                rel = img.device_memory_rel(pid)
                path = self.tmp / rel
                path.parent.mkdir(mode=img.DIR_MODE, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, img.FILE_MODE)
                # The agent records where the file will be once published, for a reload without
                # a descriptor (a lease's rollback after an interrupted restore).
                files[pid] = (fd, os.path.abspath(self.final / rel))
                try:
                    streamhash.reserve(fd, _device_memory_file_size(dm))
                except OSError as nospace:
                    raise OSError(nospace.errno, nospace.strerror, str(path)) from None
        except OSError as exc:
            for fd, _name in files.values():
                os.close(fd)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise ImageError(
                f"cannot create the device-memory file {exc.filename}: {exc.strerror}",
                why="the disk filled up since preflight" if full else "",
                fix="free space where the image is written (or write it elsewhere) and dump again; "
                "nothing was locked, the job runs on",
            ) from None
        if files:
            # The agents write them with several threads, a chunk at a time at its place: the disk
            # starts on them meanwhile, and they are hashed once the lock answered
            # (_hash_device_files).
            self.device_writeback = streamhash.WritebackFollower(self.tmp / img.DEVICE_SUBDIR).start()
        return files

    def _hash_device_files(self, *, criu_done: bool) -> None:
        """Hash the device-memory files the agents wrote (the lock answered): alongside CRIU's dump
        of the host side, on one core, where cores are to spare (HASH_ALONGSIDE_CRIU_CORES); on
        every core once CRIU is done and the job stays stopped."""
        if not criu_done and self.device_writeback is not None:
            self.device_writeback.finish()  # stopped for good (joined) at publish or rollback
        assert self.tmp is not None
        if self.device_hasher is None:
            from npusnap_cli.image import digest

            if not criu_done and digest.usable_cores() < HASH_ALONGSIDE_CRIU_CORES:
                return
            if not (self.tmp / img.DEVICE_SUBDIR).is_dir():
                return
            from npusnap_cli.image.streamhash import FileHasher

            self.device_hasher = FileHasher(self.tmp / img.DEVICE_SUBDIR)
            if criu_done and not self.options.leave_running:
                self.device_hasher.boost()
            self.device_hasher.start()
        elif criu_done and not self.options.leave_running:
            self.device_hasher.boost()  # the job stays stopped from here on: its cores are free

    def _drop_unused_device_memory_files(self, results: dict[int, dict[str, Any]]) -> None:
        """Remove the files an agent did not use (the driver-backed flow kept the memory)."""
        assert self.tmp is not None
        for pid in sorted(results):
            path = self.tmp / img.device_memory_rel(pid)
            dm = results[pid].get("device_memory") or {}
            if path.exists() and not int(dm.get("file_bytes") or 0):
                path.unlink()

    def _criu_and_publish(self, results: dict[int, dict[str, Any]], lock_start: float) -> DumpOutcome:
        from npusnap_cli import criu

        assert self.tmp is not None
        tmp = self.tmp
        criu_opts = self._criu_options()
        expected = sum(_rss(p.pid) for p in self.target.tree)
        self.cb.phase("criu dump")
        from npusnap_cli.image.streamhash import StreamHasher

        # Checksums are computed while CRIU writes, off the critical path (streamhash.py).
        hasher = self.hasher = StreamHasher(img.criu_dir(tmp)).start()
        try:
            from npusnap_cli.device.leasekeeper import keeping

            with (
                self.clock.phase("criu"),
                keeping(self.lease, [p.pid for p in self.target.tree]),
                _sampling(
                    lambda: img.tree_size(img.criu_dir(tmp)),
                    lambda n: self.cb.progress("writing image", n, max(expected, n)),
                ),
            ):
                res = criu.dump(
                    self.target.root_pid,
                    str(img.criu_dir(tmp)),
                    str(img.logs_dir(tmp)),
                    options=criu_opts,
                    log_name=img.DUMP_LOG,
                    binary=self.binary,
                    on_notify=self._on_criu_notify,
                )
        except OSError as exc:
            hasher.stop()
            raise ImageError(
                f"CRIU could not be started, or a file of the image could not be written: {exc}"
            ) from None
        except BaseException:
            hasher.stop()
            if self.lease is not None:
                self.lease.check("while CRIU ran")  # a lost lock is the cause to report
            raise
        criu_done = time.monotonic()
        self._hash_device_files(criu_done=True)
        if not self.options.leave_running:
            # The tree is stopped (leave_stopped): it is killed only after the image is published.
            self.stopped_pids = _tree_pids(self.target.root_pid)
        try:
            # After stopped_pids: a refused dump's rollback must resume the stopped tree first
            # (its agents cannot answer the unlock while CRIU's SIGSTOP holds them).
            if self.lease is not None:
                self.lease.check("before CRIU froze the tree")
            self._check_plugin_marks(tmp)
        except BaseException:
            hasher.stop()
            raise
        self.guard.check("during the CRIU dump", "rolled back")
        self._sync("criu")

        unlock_s: Optional[float] = None
        if self.options.leave_running:
            self.cb.phase("unlock")
            with self.clock.phase("unlock"):
                self.group.reconnect()
                self.group.unlock()
                self.group.close()
            unlock_s = self.clock.marks["unlock"]
            frozen_end = time.monotonic()
        else:
            frozen_end = criu_done
        manifest = self._manifest(results, res, lock_start, frozen_end, unlock_s, criu_opts)
        self.cb.phase("publish")
        try:
            with self.clock.phase("publish"):
                # After the unlock: what is left to hash no longer keeps a --leave-running job
                # frozen. Publishing waits here for the hashers (and the disk they started).
                streamed = {f"{img.CRIU_SUBDIR}/{rel}": v for rel, v in hasher.finish().items()}
                if self.device_writeback is not None:
                    self.device_writeback.stop()
                    self.device_writeback = None
                if self.device_hasher is not None:
                    done = self.device_hasher.finish().items()
                    streamed.update({f"{img.DEVICE_SUBDIR}/{rel}": v for rel, v in done})
                if not self.options.keep:
                    img.remove_tree(img.logs_dir(tmp))
                # Every file hashed (CRIU's, the device memory's), not CRIU's alone.
                total = sum(img.tree_size(tmp / d) for d in img.CHECKSUMMED_SUBDIRS)
                done = [0]

                def advance(n: int) -> None:
                    done[0] += n
                    self.cb.progress("checksums", done[0], total)

                files = img.file_entries(tmp, advance, known=streamed)
                size = sum(f.size for f in files)
                manifest = replace(
                    manifest,
                    files=files,
                    bytes=replace(manifest.bytes, image_bytes=size),
                    timings=replace(manifest.timings, total_s=time.monotonic() - self.clock.start),
                )
                self.guard.check("before the image was published", "rolled back")
                if self.lease is not None and self.stopped_pids:
                    self.lease.check_before_kill(self.stopped_pids)
                img.publish(
                    tmp, self.final, manifest, force=self.options.force, sign_key=self.options.sign_key
                )
        except OSError as exc:
            raise ImageError(
                f"writing the image failed: {exc.strerror or exc}",
                why="the disk is full or the filesystem refused a write"
                if getattr(exc, "errno", None) in (28, 122)
                else "the filesystem refused a write",
                fix=f"free space in {self.final.parent} (or choose another place) and dump again",
                details={"errno": exc.errno, "path": getattr(exc, "filename", None)},
            ) from None
        self.tmp = None  # published: nothing partial left to remove
        self._sync("publish")  # a job commits here: the originals are killed only after that
        if not self.options.leave_running:
            self.cb.phase("stop original")
            pids = self.stopped_pids or _tree_pids(self.target.root_pid)
            if self.lease is not None:
                try:
                    self.lease.check_before_kill(pids)
                except NpusnapError:
                    img.remove_tree(self.final)  # not an image of a locked job: never leave it
                    raise
            _signal_tree(pids, signal.SIGKILL)
            left = _wait_gone(pids)
            self.stopped_pids = []
            if left:
                self.cb.note(f"pid(s) {left} did not exit after SIGKILL")
        self._drop_remaps()
        timings = replace(
            manifest.timings,
            publish_s=self.clock.marks.get("publish"),
            total_s=time.monotonic() - self.clock.start,
        )
        manifest = replace(manifest, timings=timings)
        logs = str(img.logs_dir(self.final)) if self.options.keep else None
        return DumpOutcome(
            image=str(self.final),
            manifest=manifest,
            attached=self.target.attached,
            logs=logs,
            attach_stopped_s=self.target.attach_stopped_s,
        )

    def _devices(self, pid: int) -> list[int]:
        """The devices a process has open: the runtime's own word first (npusnap's LOCK_PRE
        callback, once per open device), then what the agent saw (aclrtSetDevice followed)."""
        from_callbacks = [int(d) for d in (self.lock_results.get(pid) or {}).get("callback_devices") or []]
        acl_info = (self.hello.get(pid) or {}).get("acl") or {}
        return from_callbacks or [int(d) for d in acl_info.get("devices") or []]

    def _check_plugin_marks(self, tmp: Path) -> None:
        """A dump that went through a device plugin is good only without its error line in CRIU's
        log and with its device images (what Huawei's orchestrator checks): Huawei's for Ascend
        device files, npusim_plugin.so's (one image per daemon connection) for the simulated NPU."""
        from npusnap_cli.errors import CriuError
        from npusnap_cli.host import criuplugin

        log = img.logs_dir(tmp) / img.DUMP_LOG
        problems: list[str] = []
        if any(p.device_files for p in self.target.tree):
            problems += criuplugin.scan_dump(log if log.exists() else None, img.criu_dir(tmp))
        sim = _simulated_npu_pids(self.target.tree)
        if sim:
            # A process holds a daemon connection once it opened a device.
            handles = sum(1 for pid in sim if self._devices(pid))
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

    def _manifest(
        self,
        results: dict[int, dict[str, Any]],
        res: Any,
        lock_start: float,
        frozen_end: float,
        unlock_s: Optional[float],
        criu_opts: Any,
    ) -> img.Manifest:
        npu = set(self.target.npu_pids)
        # Recorded with --leave-running too: the image holds the agents' memory from while the
        # dump held the lock, so the restored agents still know the dump as their owner.
        tokens = self.lock_tokens
        processes = []
        for p in self.target.tree:
            devices: list[int] = []
            nbytes = 0
            if p.pid in npu:
                devices = self._devices(p.pid)
                nbytes = agent_device_bytes(self.hello.get(p.pid) or {})
            processes.append(
                img.ProcessEntry(
                    pid=p.pid,
                    ppid=p.ppid,
                    cmdline=tuple(p.cmdline),
                    uid=p.uid if p.uid is not None else -1,
                    agent=p.has_agent,
                    npu=p.pid in npu,
                    devices=tuple(sorted(set(devices))),
                    device_bytes=nbytes,
                    agent_socket=p.agent_socket,
                    lock_token=tokens.get(p.pid),
                )
            )
        lock_times = [r.get("lock_elapsed_s") for r in results.values()]
        backup_times = [r.get("elapsed_s") for r in results.values()]
        stats = res.stats
        us = 1e-6
        timings = img.Timings(
            preflight_s=self.clock.marks.get("preflight"),
            lock_s=max((float(t) for t in lock_times if t is not None), default=None),
            backup_s=max((float(t) for t in backup_times if t is not None), default=None),
            criu_freeze_s=stats.freezing_time_us * us if stats else None,
            criu_memdump_s=stats.memdump_time_us * us if stats else None,
            criu_memwrite_s=stats.memwrite_time_us * us if stats else None,
            criu_total_s=self.clock.marks.get("criu"),
            unlock_s=unlock_s,
            frozen_s=frozen_end - lock_start,
            attach_stopped_s=max((s for _, s in self.target.attach_stopped_s), default=None),
        )
        page = os.sysconf("SC_PAGE_SIZE")
        return img.Manifest(
            created_at=img.now_iso(),
            versions=_versions(self.binary, self.hello),
            host=img.HostInfo.current(),
            root_pid=self.target.root_pid,
            processes=tuple(processes),
            timings=timings,
            bytes=img.ByteCounts(
                device_bytes=self.device_bytes,
                image_bytes=0,
                criu_pages_bytes=(stats.pages_written * page) if stats else 0,
            ),
            criu_options=criu_opts.to_dict(),
            leave_running=self.options.leave_running,
            host_files=self.host_files,
            host_nodes=self.host_nodes,
            pid_ns=self.pid_ns,
            external_stdio=self.external,
            device_memory=self._device_memory_record(results),
        )

    def _device_memory_record(self, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
        record = dict(self.device_memory)
        processes = {k: dict(v) for k, v in (record.get("processes") or {}).items()}
        for pid, r in results.items():
            dm = r.get("device_memory") or {}
            entry = processes.setdefault(str(pid), {})
            entry["saved_bytes"] = int(dm.get("saved_bytes") or 0)
            # "driver": the runtime and driver kept it (args != NULL); "legacy": npusnap's copy
            entry["flow"] = dm.get("flow")
            if dm.get("file_bytes"):
                entry["file"] = img.device_memory_rel(pid)  # the copy is this file, not process memory
            if dm.get("fallback"):
                entry["fallback"] = dm["fallback"]
        record["processes"] = processes
        return record


def _describe(err: BaseException) -> str:
    if isinstance(err, NpusnapError):
        return err.message
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return f"{type(err).__name__}: {err}"
