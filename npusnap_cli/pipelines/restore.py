"""The restore pipeline: verify the image, CRIU restore (detached), then Restore + Unlock each NPU process.

design.md §4, in order:

1. verify, before anything is touched: manifest schema, checksums (unless ``verify=False``),
   the same CRIU and CANN as at dump time, every pid of the image free, every device free
   (asked of the simulated NPU daemon when the image was made on the simulator);
2. pre-create the agent socket directories (0700): CRIU restores a listening socket only if
   its directory exists;
3. CRIU restore through pycriu, detached: the tree is reparented to init, not to npusnap;
4. per NPU process, in parallel: connect to its agent, Restore, run the post-restore hooks,
   Unlock. A process whose step fails stays locked (never half-running) and the error names
   the pid, the step, and how to go on (`npusnap status PID`, `npusnap thaw PID`).

With ``lazy`` (``restore --lazy``) step 3 is CRIU's lazy restore and the page files' checksums
run while the job already computes; lazypages.py supervises that phase until every page is in.
The device-memory files (``device/``) are hashed on a thread of their own that runs on into step
4: each agent Restores meanwhile and Unlocks (which loads them into the device) only after they
matched; a mismatch kills the tree with its device memory never loaded (docs/image-format.md).

The steps (``STEPS``, run by pipelines/engine.py) share a ``RestoreState``; the job restore
(jobsnap.py) runs the same steps once per rank, with barriers between them. ``preflight`` is the
one call that checks an image before anything is touched: restore, ``restore --dry-run``
(restorecheck.py) and the job restore all use it.

Core module: returns a frozen dataclass, never prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import acl, contract, criu, criuimages, safefs
from npusnap_cli import image as img
from npusnap_cli.device import hcclrebuild, occupancy
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.device.devicegroup import DeviceGroup, status_now
from npusnap_cli.errors import (
    BusyError,
    CriuError,
    DeviceError,
    ImageError,
    IncompatibleImageError,
    InterruptedError_,
    NpusnapError,
    PreflightError,
    TargetError,
    UsageError,
)
from npusnap_cli.host import ghostlock, hostclean, hostres, lazypages, pidns, procfs
from npusnap_cli.host import pidfile as pidfile_mod
from npusnap_cli.host.lazypages import LazyPhase
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.image import devchunks, digest
from npusnap_cli.pipelines import checks, restoreguard
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.engine import Pipeline, SignalGuard, Step

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
RestoreCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class RestoreOptions:
    verify: bool = True  # the checksum of every file (structure and sizes are always checked)
    pidfile: Optional[Path] = None
    lease_s: Optional[float] = None
    logs: Optional[Path] = None  # where CRIU's restore log goes (default: DIR/logs, else elsewhere)
    pipe_to: Optional[Path] = None  # new output for pipes recorded with dump --external-pipes
    replace_tmpfs_files: bool = False  # overwrite changed tmpfs files instead of refusing
    settle_s: float = 0.5  # watch the resumed tree this long; a death fails the restore
    require_signature: Optional[Path] = None  # Ed25519 public key (PEM) the image must be signed with
    accept_lost_device_memory: bool = False  # restore a --device-memory discard image anyway
    # Host memory paged in by `criu lazy-pages` while the job already runs (docs/reference/restore.md):
    # the page files are verified while it runs, and the restore returns once every page is in.
    lazy: bool = False
    lazy_timeout_s: float = 600.0  # the whole page-in (and the page files' checksums) must end by then
    # (image device, device) pairs: restore onto other devices (a --pid-ns image, simulated NPU)
    device_map: tuple[tuple[int, int], ...] = ()
    output: Optional[Path] = None  # the job writes here instead of its stdout file (a copy's own)
    tcp_close: bool = False  # established TCP connections restored closed (a copy beside the original)
    criu_passthrough: tuple[str, ...] = ()  # CRIU options passed through (criupass.parse)


@dataclass(frozen=True)
class RestoreTimings:
    verify_wait_s: float  # waiting for the checksums after CRIU (they overlap with it)
    verify_s: float
    criu_restore_s: float
    criu_forking_s: Optional[float]
    criu_restore_only_s: Optional[float]
    device_restore_s: float
    total_s: float
    # --lazy only: from the start until the last page was in and the page files were verified
    lazy_complete_s: Optional[float] = None

    def to_dict(self) -> dict[str, Optional[float]]:
        return {k: (None if v is None else round(v, 6)) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class RestoreOutcome:
    image: str
    root_pid: int
    pids: tuple[int, ...]
    npu_pids: tuple[int, ...]
    timings: RestoreTimings
    criu_log: Optional[str]
    pidfile: Optional[str] = None
    device_memory: Optional[str] = None  # npusnap | application | lost (None: image predates it)
    lazy: Optional[dict[str, Any]] = None  # --lazy: how the page-in went (LazyPhase.report)

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "root_pid": self.root_pid,
            "pids": list(self.pids),
            "npu_pids": list(self.npu_pids),
            "timings": self.timings.to_dict(),
            "criu_log": self.criu_log,
            "pidfile": self.pidfile,
            "device_memory": self.device_memory,
            "device_memory_lost": self.device_memory == "lost",
            "lazy": self.lazy,
        }


# --------------------------------------------------------------------------------------------
# Checks before anything is touched
# --------------------------------------------------------------------------------------------


def check_versions(manifest: img.Manifest, binary: criu.CriuBinary) -> None:
    """Same CRIU and CANN as at dump time (the device state format is the runtime's own)."""
    v = manifest.versions
    if binary.version != v.criu:
        raise IncompatibleImageError(
            f"the image was dumped with CRIU {v.criu}, this host has CRIU {binary.version}",
            why="npusnap restores only with the CRIU version that dumped the image",
            fix=f"install CRIU {v.criu} (./scripts/setup.sh with NPUSNAP_CRIU_VERSION={v.criu}) "
            "or set NPUSNAP_CRIU to a matching binary",
        )
    if not manifest.npu_processes:
        return
    try:
        # A shell without the CANN environment still restores: the image says where it was.
        from_image = None if os.environ.get("ASCEND_HOME_PATH") else v.cann_home
        cann = acl.find_cann(from_image)
    except acl.CannNotFound as exc:
        where = f" (the image was made with the CANN at {v.cann_home})" if v.cann_home else ""
        raise PreflightError(
            f"no CANN installation to restore the device state with{where}: {exc}",
            why=getattr(exc, "hint", ""),
            fix="set ASCEND_HOME_PATH to the CANN install (source its set_env.sh; for the "
            'simulator: eval "$(npusnap sim env)")',
        ) from None
    if cann.simulated != v.cann_simulated or (v.cann and cann.version != v.cann):
        have = f"{cann.version}{' (simulated)' if cann.simulated else ''}"
        want = f"{v.cann}{' (simulated)' if v.cann_simulated else ''}"
        raise IncompatibleImageError(
            f"the image was dumped with CANN {want}, this host has CANN {have} ({cann.home})",
            why="device state can only be restored by the runtime version that backed it up",
            fix=f"restore on a host with CANN {want}, or point ASCEND_HOME_PATH at it",
        )


def check_device_memory(manifest: img.Manifest, accept_lost: bool) -> Optional[str]:
    """Who keeps the job's device memory (from the manifest); refuse a known loss unless accepted."""
    continuity = manifest.device_memory.get("continuity")
    if continuity == "lost" and manifest.npu_processes and not accept_lost:
        raise PreflightError(
            "this image was dumped with --device-memory discard: its job's device memory is lost",
            why="CANN's Restore gives every device allocation back at its address but not its "
            "contents, and npusnap was told not to keep them: the job would run on garbage "
            "unless it rebuilds its device memory itself",
            fix="restore with --accept-lost-device-memory if the job rebuilds its device memory "
            "(nothing was touched); next time dump with --device-memory preserve (the default)",
            details={"device_memory": dict(manifest.device_memory)},
        )
    return str(continuity) if continuity else None


def _proc_desc(pid: int) -> str:
    return procfs.cmdline(pid).strip()[:80] or "?"


# A killed tree's processes stay zombies until their new parent (init) reaps them, which some
# inits do seconds late.
ZOMBIE_WAIT_S = 10.0


def image_thread_ids(image: Path, manifest: img.Manifest) -> list[int]:
    """Every pid and thread id CRIU will recreate; the image's processes must be the manifest's
    (the check `npusnap verify` and the dump make too)."""
    return img.check_process_tree(image, manifest)


def check_pids_free(manifest: img.Manifest, ids: Optional[list[int]] = None) -> None:
    """CRIU restores every process and thread with its original id: all of them must be free."""
    wanted = ids if ids is not None else [p.pid for p in manifest.processes]
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while True:
        # /proc/N exists for a thread id too (hidden from listings, but lookups find it). A pid
        # seen once can be gone a moment later: each one's state is read once per round.
        # Worth waiting for: zombies, and tasks already exiting (their memory, and with it their
        # command line, is gone before they become zombies).
        states = {i: procfs.state(i) for i in wanted}
        who = {
            i: "a zombie" if st in ("Z", "X") else _proc_desc(i) for i, st in states.items() if st is not None
        }
        for i, holder in _group_ids_in_use({i for i in wanted if i > 0} - set(who)).items():
            held = procfs.state(holder)
            if held is not None:
                what = "a zombie" if held in ("Z", "X") else f"pid {holder} ({_proc_desc(holder)})"
                who[i] = "a zombie" if what == "a zombie" else f"the session or process group of {what}"
        if not who or any(w not in ("a zombie", "?") for w in who.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if who:
        taken = sorted(who)
        original = manifest.leave_running or taken == [manifest.root_pid]
        raise BusyError(
            f"pid(s) or thread id(s) {', '.join(map(str, taken))} of the image are in use "
            f"({'; '.join(f'{i}: {who[i]}' for i in taken)})",
            why="CRIU restores processes with their original pids"
            + (" — the original process is probably still running" if original else ""),
            fix=f"stop the process(es) using them (e.g. `kill {taken[0]}` if it is the original), "
            "then restore again",
            details={"pids_in_use": taken},
        )


def _group_ids_in_use(ids: set[int]) -> dict[int, int]:
    """Id -> a process that has it as its session or process group id although no process has it
    as its pid: the kernel keeps such a pid taken (CRIU's clone fails with EEXIST). What the
    last child of a job that ended leaves until init reaps it."""
    out: dict[int, int] = {}
    if not ids:
        return out
    for name in os.listdir("/proc"):
        st = procfs.stat(name) if name.isdigit() else None
        if st is None:
            continue
        for i in (st.pgrp, st.session):
            if i in ids:
                out.setdefault(i, int(name))
    return out


def check_devices_free(
    manifest: img.Manifest,
    device_map: tuple[tuple[int, int], ...] = (),
    users: Optional[list[occupancy.DeviceUse]] = None,
) -> list[str]:
    """Restore claims the image's devices (or those of ``device_map``), which must be free of
    every other process (runtime design doc: "若Device被其他进程占用，则恢复失败"). Compared as
    physical devices (device/occupancy.py): what a copy in a container or a job with
    ASCEND_RT_VISIBLE_DEVICES calls device 0 may be another device. One that holds a device of the
    image: refused (BusyError). One without an agent cannot say which device it uses: returned as
    a note. Jobs of another CANN installation are not asked (on the simulator each tree is a node
    of its own); on a node they, like the ones without an agent, meet the runtime's own check:
    Restore refuses an occupied device (507909) and the restored process stays locked, to be
    retried or killed."""
    wanted = occupancy.image_devices(manifest, device_map)
    if not wanted:
        return []
    if users is None:
        users = device_users(manifest)
    busy = [(d, u) for u in users for d in (u.devices or ()) if d in wanted]
    if busy:
        text = ", ".join(f"device {d} by {u.who()} ({_proc_desc(u.pid)})" for d, u in busy)
        raise BusyError(
            f"device(s) of the image are occupied: {text}",
            why="the device state is restored onto the same device, which must be free of every "
            "other process",
            fix=f"stop pid {busy[0][1].pid} (or wait for it to finish)"
            + ("" if device_map else ", or restore onto free devices with --device-map")
            + ", then restore again",
            details={"busy": [{"device": d, "pid": u.pid, "ns_pid": u.ns_pid} for d, u in busy]},
        )
    unknown = [u.pid for u in users if u.devices is None]
    if not unknown:
        return []
    return [
        f"pid(s) {', '.join(map(str, unknown[:8]))} use the NPU and have no npusnap agent to say which "
        f"device: if one of them holds device(s) {sorted(wanted)}, the runtime's Restore refuses "
        "(507909) and the restored process stays locked"
    ]


def device_users(manifest: img.Manifest) -> list[occupancy.DeviceUse]:
    """The NPU processes a restore of ``manifest`` must not share a device with (``users`` of
    check_devices_free: one look for several checks)."""
    # Without a pid namespace of its own an image pid in use is the pid check's (the original,
    # usually); with one, the original keeps its host pids and is just another process here.
    image_pids = frozenset() if manifest.pid_ns else frozenset(p.pid for p in manifest.processes)
    v = manifest.versions
    return occupancy.device_users(v.cann_home, bool(v.cann_simulated), image_pids)


def prepare_sockets(manifest: img.Manifest) -> None:
    """Create each agent socket's directory (0700) and refuse what CRIU would trip over.

    The manifest was checked (imagetrust.check_manifest): each socket is ``<pid>.sock`` in an
    agent runtime directory. Only that last directory is created, never its parents, and an
    existing one must be a real directory of root or the process's user, writable by nobody else.
    """
    for p in manifest.processes:
        if not p.agent_socket:
            continue
        sock = Path(p.agent_socket)
        parent = sock.parent
        try:
            parent.mkdir(mode=0o700)
            if os.geteuid() == 0 and p.uid > 0:
                # The job's own directory (/tmp/npusnap-UID): its agents, and the user's
                # npusnap, create and check sockets there; root's would shut them out.
                os.chown(parent, p.uid, -1, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError as exc:
            raise PreflightError(
                f"cannot create the agent socket directory {parent}: {exc.strerror}",
                fix=f"create it (mode 0700, owned by uid {p.uid}) or run as the image's user/root",
            ) from None
        check_socket_dir(sock, p.uid, parent.lstat())


def check_socket_dir(sock: Path, uid: int, st: os.stat_result) -> None:
    """Refuse an agent socket directory (``st``, not followed) or a name in it that CRIU would trip
    over, or another user could use to replace the restored control socket."""
    parent = sock.parent
    if not stat.S_ISDIR(st.st_mode):
        raise PreflightError(f"{parent} is not a directory", fix=f"remove it: rm {parent}")
    if st.st_uid not in (0, uid, os.geteuid()) or stat.S_IMODE(st.st_mode) & 0o022:
        raise PreflightError(
            f"refusing the agent socket directory {parent}: owned by uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):o}",
            why="another user could replace the restored control socket there",
            fix=f"remove it (rm -r {parent}) if it is not the job's, then restore again",
        )
    with contextlib.suppress(FileNotFoundError):
        sst = sock.lstat()
        if not stat.S_ISSOCK(sst.st_mode):
            raise PreflightError(
                f"{sock} exists and is not a socket",
                why="CRIU restores the agent's listening socket at that path",
                fix=f"remove it: rm {sock}",
            )


# --------------------------------------------------------------------------------------------
# Preflight: every check before anything is touched, in the restore's order
# --------------------------------------------------------------------------------------------


@dataclass
class Preflight:
    """What a check reads (the image, its manifest, the options) and what the checks found.

    ``dry_run``: check only (``restore --dry-run``): no directory is created; a real restore
    creates the agents' socket directories and the directory of CRIU's log here.
    """

    image: Path
    manifest: img.Manifest
    options: RestoreOptions
    dry_run: bool = False
    binary: Optional[criu.CriuBinary] = None
    device_memory: Optional[str] = None  # who keeps it (check_device_memory)
    thread_ids: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth telling, not a problem
    to_put_back: list[hostres.HostFile] = field(default_factory=list)
    to_make: list[hostres.HostNode] = field(default_factory=list)
    logs: Optional[Path] = None  # where CRIU's restore log goes
    note: Optional[Callable[[str], None]] = None  # also told each note as it is found

    def tell(self, text: str) -> None:
        self.notes.append(text)
        if self.note is not None:
            self.note(text)

    def criu_binary(self) -> criu.CriuBinary:
        if self.binary is None:
            self.binary = criu.find_criu()
        return self.binary


Check = checks.Check[Preflight]  # restore's checks read its Preflight


def _versions(pf: Preflight) -> str:
    binary = pf.criu_binary()
    check_versions(pf.manifest, binary)
    v = pf.manifest.versions
    return f"CRIU {binary.version}" + (f", CANN {v.cann}" if pf.manifest.npu_processes else "")


def _lazy(pf: Preflight) -> str:
    lazypages.check_lazy(pf.image, pf.manifest, pf.criu_binary())
    return "CRIU can serve the pages lazily"


def _device_memory(pf: Preflight) -> str:
    pf.device_memory = check_device_memory(pf.manifest, pf.options.accept_lost_device_memory)
    return f"kept by {pf.device_memory or '-'}"


def _pids(pf: Preflight) -> str:
    pf.thread_ids = image_thread_ids(pf.image, pf.manifest)
    if pf.manifest.pid_ns:  # a job's own pid namespace is restored afresh: no host pid needed
        return "a pid namespace of its own (`run --pid-ns`): no host pid needed"
    check_pids_free(pf.manifest, pf.thread_ids)
    return f"{len(pf.thread_ids)} pid(s) and thread id(s) free"


def _devices(pf: Preflight) -> str:
    pidns.check_device_map(pf.manifest, pf.options.device_map)
    notes = check_devices_free(pf.manifest, pf.options.device_map)
    for n in notes:
        pf.tell(n)
    devices = sorted(occupancy.image_devices(pf.manifest, pf.options.device_map))
    return f"device(s) {', '.join(map(str, devices)) or '-'} free" + "".join(f"; {n}" for n in notes)


def _socket_dirs(pf: Preflight) -> str:
    if not pf.dry_run:
        prepare_sockets(pf.manifest)
        return "present and private"
    made = []
    for p in pf.manifest.processes:
        if not p.agent_socket:
            continue
        sock = Path(p.agent_socket)
        parent = sock.parent
        try:
            st = parent.lstat()
        except FileNotFoundError:
            if not os.access(parent.parent, os.W_OK | os.X_OK):
                raise PreflightError(
                    f"cannot create the agent socket directory {parent}",
                    fix=f"create it (mode 0700, owned by uid {p.uid}) or run as the image's user/root",
                ) from None
            made.append(str(parent))
            continue
        check_socket_dir(sock, p.uid, st)
    return f"would create {', '.join(made)}" if made else "present and private"


def _listeners(pf: Preflight) -> str:
    agents = [p.agent_socket for p in pf.manifest.processes]
    paths = hostres.check_listeners_free(img.criu_dir(pf.image), agents)
    return f"{len(paths)} unix listener path(s), none taken" if paths else "none"


def _host_files(pf: Preflight) -> str:
    m = pf.manifest
    pf.to_put_back = hostres.check_put_back(
        m.host_files,
        replace=pf.options.replace_tmpfs_files,
        uids={p.uid for p in m.processes},
        nodes=m.host_nodes,
    )
    pf.to_make = hostres.check_host_nodes(m.host_nodes)
    found = f"would put back {len(pf.to_put_back)} file(s)" if pf.to_put_back else "nothing to put back"
    if pf.to_make:
        found += f"; would create {len(pf.to_make)} director(ies)/fifo(s)"
    return found


def _pipes(pf: Preflight) -> str:
    pipes = [e for e in pf.manifest.external_stdio if e.kind == "pipe"]
    target = pf.options.pipe_to
    if not pipes:
        return "none recorded" + (" (--pipe-to is not needed)" if target is not None else "")
    if target is None:
        e = pipes[0]
        raise PreflightError(
            f"the image's pid {e.pid} wrote to a pipe to a process outside the tree (fd {e.fd})",
            why="the reader of that pipe is not in the image; restored as it was, the job would die "
            "of SIGPIPE at its next write",
            fix="rerun restore with --pipe-to FILE: the job then writes there",
            details={"external_stdio": [x.to_dict() for x in pf.manifest.external_stdio]},
        )
    parent = Path(target).parent
    if pf.dry_run and (Path(target).is_symlink() or not os.access(parent if str(parent) else ".", os.W_OK)):
        raise PreflightError(f"cannot open --pipe-to {target}", fix="name a writable file (not a symlink)")
    return f"{len(pipes)} pipe(s) -> {target}"


def _logs(pf: Preflight) -> str:
    wanted = pf.options.logs
    if not pf.dry_run:
        pf.logs = restore_logs_dir(pf.image, wanted, pf.tell)
        return f"CRIU's log -> {pf.logs / img.RESTORE_LOG}"
    if wanted is not None:
        if not writable_dir(wanted, parents=True):
            raise UsageError(f"cannot write CRIU's restore log into {wanted}", fix="pass a writable --logs")
        return f"CRIU's log -> {wanted}"
    inside = img.logs_dir(pf.image)
    if writable_dir(inside, parents=False):
        return f"CRIU's log -> {inside / img.RESTORE_LOG}"
    return "the image is not writable: CRIU's log would go under $TMPDIR/npusnap-logs"


def _pidfile(pf: Preflight) -> str:
    assert pf.options.pidfile is not None  # skipped without --pidfile
    pidfile_mod.check(pf.options.pidfile)
    return f"-> {pf.options.pidfile}"


# In the restore's order; ``restore --dry-run`` runs the image's structure and checksums first.
CHECKS: tuple[Check, ...] = (
    Check("versions", "same CRIU and CANN as at dump time", _versions),
    Check(
        "lazy-pages", "CRIU's lazy pages", _lazy, skip=lambda pf: None if pf.options.lazy else "not --lazy"
    ),
    Check("device-memory", "who keeps the device memory", _device_memory),
    Check("pids", "the image's pids and thread ids are free", _pids),
    Check("devices", "the image's NPU devices are free", _devices),
    Check("agent-sockets", "the agents' socket directories", _socket_dirs),
    Check("unix-listeners", "no running process listens where the job's sockets bind", _listeners),
    Check("host-files", "tmpfs and deleted files to put back", _host_files),
    Check("pipes", "pipes to outside the tree (--pipe-to)", _pipes),
    Check("logs", "where CRIU's restore log goes", _logs),
    Check(
        "pidfile",
        "--pidfile can be written",
        _pidfile,
        skip=lambda pf: None if pf.options.pidfile is not None else "no --pidfile",
    ),
)


def preflight(
    image: Path,
    manifest: img.Manifest,
    options: RestoreOptions,
    binary: Optional[criu.CriuBinary] = None,
    *,
    note: Optional[Callable[[str], None]] = None,
) -> Preflight:
    """Every check of ``CHECKS`` in order, creating what a restore needs (the agents' socket
    directories, CRIU's log directory); raises the first problem's NpusnapError."""
    pf = Preflight(image, manifest, options, binary=binary, note=note)
    checks.run_in_order(CHECKS, pf)
    return pf


def criu_options(manifest: img.Manifest, inherit_fd: tuple[tuple[str, int], ...] = ()) -> criu.CriuOptions:
    """The options CRIU dumped the image with, as its restore needs them."""
    o = manifest.criu_options
    lock = o.get("network_lock")
    return criu.CriuOptions(
        tcp_established=bool(o.get("tcp_established")),
        shell_job=bool(o.get("shell_job")),
        file_locks=bool(o.get("file_locks")),
        ext_unix_sk=bool(o.get("ext_unix_sk")),
        external=tuple(str(x) for x in o.get("external") or ()),
        link_remap=bool(o.get("link_remap", False)),
        network_lock=lock if lock in criu.NETWORK_LOCKS else None,
        inherit_fd=inherit_fd,
    )


def open_pipe_targets(manifest: img.Manifest, pipe_to: Optional[Path]) -> list[tuple[str, int]]:
    """(CRIU key, fd) for each pipe recorded by dump --external-pipes, all opened on ``pipe_to``."""
    keys = sorted({e.key for e in manifest.external_stdio if e.kind == "pipe"})
    if not keys:
        return []
    if pipe_to is None:
        e = manifest.external_stdio[0]
        raise PreflightError(
            f"the image's pid {e.pid} wrote to a pipe to a process outside the tree (fd {e.fd})",
            why="the reader of that pipe is not in the image; restored as it was, the job would die "
            "of SIGPIPE at its next write",
            fix="rerun restore with --pipe-to FILE: the job then writes there",
            details={"external_stdio": [x.to_dict() for x in manifest.external_stdio]},
        )
    try:
        # No user's symlink on the way, no hard link; the file is ours or the job's user's.
        owners = {os.geteuid(), *(p.uid for p in manifest.processes if p.uid >= 0)}
        out = safefs.open_append(str(pipe_to), owners=owners)
    except OSError as exc:
        raise PreflightError(
            f"cannot open --pipe-to {pipe_to}: {exc.strerror}",
            fix="name a writable file (not a symlink) for the job's output",
        ) from None
    # The job gets a new pipe, not the file itself: CRIU re-opens an inherited pipe end through
    # /proc/self/fd with the pipe's flags, which would drop O_APPEND and start at offset 0 (the
    # job would overwrite the file). A detached `cat` is the pipe's new reader, as `tee` was.
    r, w = os.pipe()
    try:
        subprocess.Popen(
            ["cat"], stdin=r, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True
        )
    except OSError as exc:
        os.close(w)
        raise PreflightError(
            f"cannot start the reader for --pipe-to: {exc}", fix="check that cat is installed"
        ) from None
    finally:
        os.close(r)
        os.close(out)
    return [(key, w) for key in keys]


def become_subreaper() -> bool:
    """Make the restored tree's root our child once CRIU exits, so that we can read its exit
    status (a job that finished cleanly in the settle time is not a failed restore).

    Only for a short-lived process (the CLI): a long-lived one would collect zombies that hold
    the pids a later restore needs.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _exit_status(pid: int) -> Optional[int]:
    """The wait status of ``pid`` if it is our (subreaped) child and has exited, else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return status if got == pid else None


def check_alive_after(pids: tuple[int, ...], settle_s: float, log: str) -> list[str]:
    """Never report "running" of a process that died: watch the tree a moment after it resumed.

    The root is npusnap's child once CRIU exits (``become_subreaper``), so its exit status is
    known: a failure status fails the restore. Other processes that are gone are reported in
    the returned notes, as are clean exits.
    """
    end = time.monotonic() + settle_s
    statuses: dict[int, Optional[int]] = {}
    while True:
        for p in pids:
            if p not in statuses and not procfs.is_alive(p):
                statuses[p] = _exit_status(p)
        if len(statuses) == len(pids) or time.monotonic() >= end:
            break
        time.sleep(0.05)
    ok = [p for p, st in statuses.items() if st is not None and os.waitstatus_to_exitcode(st) == 0]
    unknown = [p for p, st in statuses.items() if st is None]
    dead = {p: st for p, st in statuses.items() if st is not None and p not in ok}
    if dead:
        how = "; ".join(f"{p}: {_describe_status(st)}" for p, st in dead.items())
        raise TargetError(
            f"the restored process(es) died right after resuming ({how})",
            why="they were restored but ended within the first moments: usually a resource "
            "restored as it was but no longer usable (a pipe whose reader is gone, a peer that "
            "went away, a file changed underneath it)",
            fix=f"read the job's own output/log and the CRIU log {log}; for pipes, dump with "
            "--external-pipes and restore with --pipe-to FILE",
            details={"dead_pids": sorted(dead), "criu_log": log},
        )
    notes = [f"pid {p} finished (exit status 0) right after the restore" for p in ok]
    notes += [
        f"pid {p} exited right after the restore (not npusnap's child: its exit status is unknown; "
        "see the job's output)"
        for p in unknown
    ]
    return notes


def _describe_status(status: Optional[int]) -> str:
    if status is None:
        return "gone (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"


# --------------------------------------------------------------------------------------------
# The pipeline: steps over a RestoreState (pipelines/engine.py runs them)
# --------------------------------------------------------------------------------------------


@dataclass
class RestoreState:
    """What the restore's steps share; the job restore (jobsnap.py) extends it per rank."""

    image: Path  # the image directory (a pointer followed)
    manifest: img.Manifest  # after CRIU, of a --pid-ns image: with the restored copy's host pids
    options: RestoreOptions
    cb: PipelineCallbacks
    guard: SignalGuard
    start: float = field(default_factory=time.monotonic)
    # True: the checksums are computed while the checks and CRIU run, and CRIU leaves the tree
    # stopped until they matched. False (a job's ranks): every checksum is known first.
    overlap: bool = True
    binary: Optional[criu.CriuBinary] = None
    # pstree.img id -> the signal that stopped it, of the processes CRIU restores stopped
    stopped_in_image: Optional[dict[int, int]] = None
    pre: Optional[Preflight] = None
    checksums: Optional[Checksums] = None
    device_checks: Optional[Checksums] = None  # the device-memory files, on into the device step
    assembly: Optional[devchunks.Assembly] = None  # chunked device memory put together, ditto
    device_memory_files: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (fd, name)
    inherit: list[tuple[str, int]] = field(default_factory=list)  # CRIU key -> fd (--pipe-to, --output)
    made: list[str] = field(default_factory=list)  # host directories and fifos created for the job
    created: list[hostres.HostFile] = field(default_factory=list)  # files put back that were absent
    lazy: Optional[LazyPhase] = None
    stop_guard: Optional[StopGuard] = None
    view: Optional[Path] = None  # a --pid-ns image's CRIU directory as this copy restores it
    result: Optional[criu.RestoreResult] = None
    verified_at: float = 0.0
    criu_done: float = 0.0
    released: float = 0.0
    device_done: float = 0.0
    pidfile: Optional[str] = None
    pidfile_error: Optional[NpusnapError] = None
    lazy_report: Optional[dict[str, Any]] = None

    @property
    def checked(self) -> Preflight:
        if self.pre is None:
            raise RuntimeError("the restore's preflight step did not run")
        return self.pre

    @property
    def restored(self) -> criu.RestoreResult:
        if self.result is None:
            raise RuntimeError("CRIU's restore step did not run")
        return self.result

    @property
    def npu_pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.manifest.npu_processes)

    def close(self) -> None:
        """Whatever the outcome: stop hashing, close the files the steps opened."""
        for c in (self.checksums, self.device_checks, self.assembly):
            if c is not None:
                c.cancel()
                c.join()
        _close_inherited(self)
        for fd, _path in self.device_memory_files.values():
            os.close(fd)
        self.device_memory_files = {}

    def outcome(self) -> RestoreOutcome:
        res = self.restored
        stats = res.stats
        verify_s = self.verified_at - self.start
        return RestoreOutcome(
            image=str(self.image),
            root_pid=res.pid,
            pids=tuple(p.pid for p in self.manifest.processes),
            npu_pids=self.npu_pids,
            timings=RestoreTimings(
                verify_wait_s=self.released - self.criu_done,
                verify_s=verify_s,
                criu_restore_s=self.criu_done - self.start - verify_s,
                criu_forking_s=stats.forking_time_us * 1e-6 if stats else None,
                criu_restore_only_s=stats.restore_time_us * 1e-6 if stats else None,
                device_restore_s=self.device_done - self.released,
                total_s=self.device_done - self.start,
                lazy_complete_s=self.lazy_report["complete_s"] if self.lazy_report else None,
            ),
            criu_log=res.log_path,
            pidfile=self.pidfile,
            device_memory=self.checked.device_memory,
            lazy=self.lazy_report,
        )


def _verify(st: RestoreState) -> None:
    """Structure and sizes now; the checksum of every file in a thread that overlaps with the
    checks and with CRIU's own reading. CRIU leaves the restored tree stopped until the sums are
    known: nothing of the image runs before it is verified."""
    o = st.options
    if not st.overlap:
        img.verify(st.image, checksums=o.verify, require_signature=o.require_signature)
        return
    total = sum(f.size for f in st.manifest.files)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        st.cb.progress("verifying", done[0], total)

    img.verify(st.image, checksums=False, require_signature=o.require_signature)
    # Chunks and their indexes are checked while restore puts them together (_open_files).
    chunked = [f for f in st.manifest.files if devchunks.is_chunk_layout_rel(f.path)]
    device_entries = [
        f for f in st.manifest.files if f.path.startswith(img.DEVICE_SUBDIR + "/") and f not in chunked
    ]
    if o.verify and o.lazy:
        # Lazy: everything but the page files now (small: CRIU's metadata, tmpfs copies); the page
        # files while the job already runs (lazypages.py's contract, docs/image-format.md).
        pages, rest = lazypages.split_page_files(st.manifest)
        verify_entries(st.image, rest, advance)
        st.checksums = Checksums(st.image, advance, entries=pages)
    elif o.verify and (device_entries or chunked):
        # The device-memory files on a thread of their own: the tree may run once everything
        # else matched (its host memory is verified; its device calls are held until the
        # agents reload), and the agents reload them only after they matched too.
        others = [f for f in st.manifest.files if f not in device_entries and f not in chunked]
        st.checksums = Checksums(st.image, advance, entries=others)
        if device_entries:
            # On every core: with the device memory kept poisoned by the simulator (or on a
            # device), the agents' Restore answers at once, and this is what their reload waits for.
            st.device_checks = Checksums(
                st.image, advance, entries=device_entries, threads=digest.usable_cores()
            )
    elif o.verify:
        st.checksums = Checksums(st.image, advance)
    if st.checksums is not None and not o.lazy and _stopped_by_other_signals(st):
        # CRIU's --leave-stopped stops every task with SIGSTOP at the end, and a task that was
        # stopped by another signal (a shell's ^Z: SIGTSTP) would then report SIGSTOP to its
        # parent: verify first, and let CRIU restore each task's own stop.
        error = st.checksums.join()
        st.checksums = None
        if error is not None:
            raise error


def _stopped_by_other_signals(st: RestoreState) -> bool:
    return any(sig not in (0, signal.SIGSTOP) for sig in _image_stops(st).values())


def _image_stops(st: RestoreState) -> dict[int, int]:
    if st.stopped_in_image is None:
        st.stopped_in_image = criuimages.stopped(img.criu_dir(st.image))
    return st.stopped_in_image


def _preflight(st: RestoreState) -> None:
    try:
        st.pre = preflight(st.image, st.manifest, st.options, st.binary, note=st.cb.note)
    except BusyError:
        # A corrupt image is the answer that holds after the original is stopped (exit 8, not 11).
        for c in (st.checksums, st.device_checks):
            corrupt = c.join() if c is not None else None
            if corrupt is not None:
                raise corrupt from None
        raise


def _open_files(st: RestoreState) -> None:
    """The device-memory files, and the new outputs of --pipe-to and --output: once CRIU has
    started, nothing of the restore may depend on the image staying where it is (a lazy
    restore's image may be removed)."""
    st.device_memory_files = img.open_device_memory_files(st.image, st.manifest)
    indexes = devchunks.read_indexes(st.image, st.manifest)
    if indexes:
        st.assembly = devchunks.Assembly(
            st.image, indexes, verify=st.options.verify, threads=digest.usable_cores()
        )
        for pid, fd in st.assembly.memfds.items():
            st.device_memory_files[pid] = (fd, os.path.abspath(st.image / devchunks.index_rel(pid)))
    st.inherit = open_pipe_targets(st.manifest, st.options.pipe_to)
    st.inherit += pidns.open_output_target(img.criu_dir(st.image), st.manifest, st.options.output)
    st.verified_at = time.monotonic()


def _close_inherited(st: RestoreState) -> None:
    for fd in {fd for _key, fd in st.inherit}:
        os.close(fd)
    st.inherit = []


def _make_host_nodes(st: RestoreState) -> None:
    to_make = st.checked.to_make
    if to_make:
        st.cb.note(f"creating {len(to_make)} director(ies)/fifo(s) the job needs: {to_make[-1].path}")
        st.made = hostres.make_host_nodes(
            to_make, {p.uid for p in st.manifest.processes}, st.manifest.host_nodes
        )


def _remove_host_nodes(st: RestoreState, _err: BaseException) -> None:
    hostres.remove_host_nodes(st.made)


def _put_back(st: RestoreState) -> None:
    to_put_back = st.checked.to_put_back
    if not to_put_back:
        return
    st.cb.note(f"putting back {len(to_put_back)} file(s) from the image (tmpfs, deleted files)")
    st.created = hostres.absent(to_put_back)  # removed again if the restore fails
    try:
        hostres.put_back(to_put_back, st.image, st.manifest.host_nodes)
    except BaseException:
        hostres.remove_copies(st.created)
        raise


def _remove_put_back(st: RestoreState, _err: BaseException) -> None:
    hostres.remove_copies(st.created)  # a failed restore leaves no file it wrote


def _start_lazy(st: RestoreState) -> None:
    """--lazy: the `criu lazy-pages` daemon, listening in the restore's work directory."""
    if not st.options.lazy:
        return
    logs = str(st.checked.logs)
    daemon = criu.LazyPagesDaemon(st.checked.criu_binary(), str(img.criu_dir(st.image)), logs)
    pids = [p.pid for p in st.manifest.processes]
    st.lazy = LazyPhase(
        daemon, pids, st.checksums, st.options.lazy_timeout_s, st.start, str(Path(logs) / img.RESTORE_LOG)
    )


def _abort_lazy(st: RestoreState, _err: BaseException) -> None:
    if st.lazy is not None:
        st.lazy.abort()


def _stays_stopped(st: RestoreState) -> bool:
    """CRIU leaves the tree stopped until npusnap releases it (verified, or its pages served)."""
    return st.checksums is not None or st.options.lazy


def _start_stop_guard(st: RestoreState) -> None:
    """Should npusnap die before it released the stopped tree, the watcher kills the CRIU it
    starts next and its unverified tree (a new restore brings it back)."""
    if _stays_stopped(st):
        st.stop_guard = restoreguard.restore_stop_guard()


def _enter_device_view(st: RestoreState) -> None:
    """--device-map: CRIU, and so the tree, start in a container of the simulated NPU holding
    the mapped devices (host/pidns.py)."""
    if st.options.device_map:
        held = pidns.enter_device_view(st.manifest, st.options.device_map)
        st.cb.note(f"the restored tree runs in a container of the simulated NPU holding device(s) {held}")


def _make_view(st: RestoreState) -> None:
    """A --pid-ns image: the CRIU image directory as this copy restores it (host/pidns.py)."""
    if st.manifest.pid_ns:
        st.view = pidns.criu_view(img.criu_dir(st.image), st.manifest)


def _drop_view(st: RestoreState, _err: Optional[BaseException] = None) -> None:
    if st.view is not None:
        pidns.drop_view(st.view)
        st.view = None


def _criu_restore(st: RestoreState) -> None:
    """CRIU restores the tree, detached; it stays stopped while checksums or lazy pages are
    pending. A failure here leaves nothing CRIU restored; a corrupt image, or another restore
    that took the image's pids, is the better explanation of it."""
    pre = st.checked
    try:
        # CRIU's ghost files have one name per image: overlapping restores of it take turns here
        with ghostlock.for_image(img.criu_dir(st.image), st.cb.note):
            st.result = criu.restore(
                str(st.view or img.criu_dir(st.image)),
                str(pre.logs),
                options=replace(
                    criu_options(st.manifest, tuple(st.inherit)),
                    # lazy: stopped until npusnap holds the daemon's userfaultfds (lazypages.py)
                    leave_stopped=_stays_stopped(st),
                    lazy_pages=st.lazy is not None,
                    tcp_close=pre.options.tcp_close,
                    passthrough=pre.options.criu_passthrough,
                ),
                log_name=img.RESTORE_LOG,
                binary=pre.criu_binary(),
                on_notify=st.lazy.on_notify if st.lazy is not None else None,
            )
    except NpusnapError as err:
        corrupt = st.checksums.join() if st.checksums is not None else None
        if corrupt is not None:
            raise corrupt from None
        pids = [p.pid for p in st.manifest.processes]
        busy = restoreguard.concurrent_restore(err, pids) if isinstance(err, CriuError) else None
        if busy is not None:
            raise busy from None
        raise
    finally:
        _drop_view(st)
        _close_inherited(st)
        hostres.drop_remaps(pre.to_put_back)  # CRIU's restore consumes them; a failed one leaves them
    st.criu_done = time.monotonic()
    if st.stop_guard is not None:
        st.stop_guard.tell("tree", st.restored.pid)


def _finish_stop_guard(st: RestoreState, _err: Optional[BaseException] = None) -> None:
    if st.stop_guard is not None:
        st.stop_guard.finish()
        st.stop_guard = None


def _release(st: RestoreState) -> None:
    """A --pid-ns copy's host pids; then the stopped tree runs once verified."""
    root_pid = st.restored.pid
    try:
        stopped = _stopped_in_image(st) if _stays_stopped(st) else set()
        if st.manifest.pid_ns:  # from here on, the restored copy's host pids
            st.manifest, moved = pidns.translate(st.manifest, root_pid)
            st.device_memory_files = {moved.get(k, k): v for k, v in st.device_memory_files.items()}
            stopped = {moved.get(p, p) for p in stopped}
        if st.lazy is not None:
            st.lazy.criu_log = st.restored.log_path
            st.lazy.guard()
            st.lazy.release(stays_stopped=stopped)
            st.cb.note(
                f"the job runs (root pid {root_pid}) while CRIU's lazy-pages daemon (pid "
                f"{st.lazy.daemon.pid}, log {st.lazy.daemon.log_path}) pages in the rest of its memory"
                + (" and its page files are verified" if st.checksums is not None else "")
                + "; npusnap watches until every page is in"
            )
        elif st.checksums is not None:
            _release_when_verified(st.manifest, st.checksums, st.cb, stopped)
    finally:
        _finish_stop_guard(st)  # released (or killed unverified): nothing left stopped
    st.released = time.monotonic()


def _write_pidfile(st: RestoreState) -> None:
    """Written before the device step: if that fails the tree is running (locked), and the
    operator's scripts need its pid all the same. A write that fails in spite of the check
    must not leave the job locked: the device step runs first, the error comes after."""
    assert st.options.pidfile is not None
    try:
        st.pidfile = pidfile_mod.write(st.options.pidfile, st.restored.pid)
    except NpusnapError as err:
        st.pidfile_error = err


def _device_restore(st: RestoreState) -> None:
    """Restore + Unlock every NPU process (each as soon as its own Restore is done)."""
    res = st.restored
    npu_pids = st.npu_pids
    img.stop_point("restore:device-restore")
    try:
        if npu_pids:
            tokens = {p.pid: p.lock_token for p in st.manifest.npu_processes if p.lock_token}
            before_unlock = None
            waits = [c for c in (st.device_checks, st.assembly) if c is not None]
            if waits:
                before_unlock = _device_files_verified(st.manifest, waits, st.cb)
            _restore_and_unlock(
                npu_pids, st.options, res.pid, res.log_path, tokens, st.device_memory_files, before_unlock,
                st.guard,
            )  # fmt: skip
            rebuild_communicators(npu_pids, res.pid, st.cb.note)
        _check_none_left_locked(st.manifest, res.pid, res.log_path)
        st.device_done = time.monotonic()
        settle(st)
    except NpusnapError as err:
        if st.lazy is not None:
            # The tree stays (locked, or partly running): its memory must still come in, or it dies.
            try:
                st.lazy.finish()
            except NpusnapError as lazy_err:
                raise lazy_err from err
        raise


def settle(st: RestoreState) -> None:
    """Watch the resumed tree ``settle_s``: a process that died fails the restore."""
    res = st.restored
    watched = tuple(dict.fromkeys((res.pid, *st.npu_pids)))
    for note in check_alive_after(watched, st.options.settle_s, res.log_path):
        st.cb.note(note)


def _lazy_page_in(st: RestoreState) -> None:
    assert st.lazy is not None
    st.lazy_report = st.lazy.finish()


def _report(st: RestoreState) -> None:
    err = st.pidfile_error
    if err is not None:
        err.message = f"restored and running (root pid {st.restored.pid}), but {err.message}"
        err.details["restored_root_pid"] = st.restored.pid
        raise err
    if st.guard.received is not None:
        st.cb.note(f"{st.guard.name} was received during the restore; the restore was completed first")


# A signal before CRIU starts stops the restore with nothing touched; once CRIU has started,
# stopping halfway would leave processes locked with nobody to restore them, so it finishes.
UNTOUCHED = ("before anything was started", "nothing was restored")
VERIFY: Step[RestoreState] = Step("verify", _verify, phase="verify", checkpoint=UNTOUCHED)
PREFLIGHT: Step[RestoreState] = Step("preflight", _preflight, checkpoint=UNTOUCHED)
OPEN_FILES: Step[RestoreState] = Step("open files", _open_files, checkpoint=UNTOUCHED)
HOST_NODES: Step[RestoreState] = Step(
    "host nodes", _make_host_nodes, _remove_host_nodes, checkpoint=UNTOUCHED
)
PUT_BACK: Step[RestoreState] = Step("put back files", _put_back, _remove_put_back, checkpoint=UNTOUCHED)


def _criu_phase(st: RestoreState) -> str:
    return "criu restore" + (" (lazy pages)" if st.options.lazy else "")


DEVICE_VIEW: Step[RestoreState] = Step("device view", _enter_device_view, checkpoint=UNTOUCHED)
# These three make what CRIU's restore needs, each only where it applies (and announce its phase).
PID_NS_VIEW: Step[RestoreState] = Step(
    "pid-ns view", _make_view, _drop_view, phase=_criu_phase, checkpoint=UNTOUCHED
)
LAZY_DAEMON: Step[RestoreState] = Step("lazy-pages daemon", _start_lazy, _abort_lazy, checkpoint=UNTOUCHED)
STOP_GUARD: Step[RestoreState] = Step(
    "stop guard", _start_stop_guard, _finish_stop_guard, checkpoint=UNTOUCHED
)
# The single restore's commit: once CRIU restored the tree, stopping would leave it locked.
CRIU_RESTORE: Step[RestoreState] = Step("criu restore", _criu_restore, commit=True)
RELEASE: Step[RestoreState] = Step("release", _release)
PIDFILE: Step[RestoreState] = Step("pidfile", _write_pidfile, when=lambda st: st.options.pidfile is not None)
DEVICE_RESTORE: Step[RestoreState] = Step("device restore", _device_restore, phase="device restore")
LAZY_PAGE_IN: Step[RestoreState] = Step(
    "lazy page-in", _lazy_page_in, phase="lazy page-in", when=lambda st: st.lazy is not None
)
REPORT: Step[RestoreState] = Step("report", _report)

STEPS: tuple[Step[RestoreState], ...] = (
    VERIFY,
    PREFLIGHT,
    # Before the files the restored tree inherits (--output) are opened: opened in the host's
    # mount namespace, they would be on a mount the tree's own namespace does not have, and CRIU
    # could not dump the copy again ("Can't lookup mount").
    DEVICE_VIEW,
    OPEN_FILES,
    HOST_NODES,
    PUT_BACK,
    PID_NS_VIEW,
    LAZY_DAEMON,
    STOP_GUARD,
    CRIU_RESTORE,
    RELEASE,
    PIDFILE,
    DEVICE_RESTORE,
    LAZY_PAGE_IN,
    REPORT,
)


def restore(
    directory: Path,
    options: RestoreOptions = RestoreOptions(),
    callbacks: RestoreCallbacks = RestoreCallbacks(),
) -> RestoreOutcome:
    """Run the whole restore pipeline (see the module docstring); raise NpusnapError on failure."""
    with SignalGuard(callbacks.note, what="restore") as guard:
        final = img.follow_pointer(directory)
        state = RestoreState(final, img.load_manifest(final), options, callbacks, guard)
        try:
            Pipeline("restore", STEPS, cb=callbacks, guard=guard).run(state)
        finally:
            state.close()
        return state.outcome()


def verify_entries(
    image: Path, entries: list[img.FileEntry], progress: Optional[Callable[[int], None]] = None
) -> None:
    """The checksum of each of ``entries`` (sizes were checked by ``img.verify``); ImageError if
    one differs."""
    digests = digest.of_files([(image / e.path, e.algo) for e in entries], progress)
    bad = [digest.mismatch(e.path, e.algo) for e, d in zip(entries, digests) if d != e.digest]
    if bad:
        raise img.verification_error(image, bad)


class Checksums:
    """``img.verify`` with checksums (or the checksums of ``entries`` only), on its own thread.

    ``on_error`` runs on that thread as soon as a file does not match (lazy restore: the job is
    already running and must be stopped at once)."""

    def __init__(
        self,
        image: Path,
        progress: Optional[Callable[[int], None]],
        entries: Optional[list[img.FileEntry]] = None,
        threads: int = 1,
    ) -> None:
        self.error: Optional[BaseException] = None
        self.on_error: Optional[Callable[[BaseException], None]] = None
        self.done_at: Optional[float] = None
        self._stop = threading.Event()
        opened = None
        if entries is not None:
            # Opened now: removing the image while the job is paged in changes nothing (the
            # daemon holds its own fds of the same files).
            opened = lazypages.open_files(image, entries)
        self._threads = threads
        self._thread = threading.Thread(
            target=self._run, args=(image, progress, opened), name="npusnap-verify"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run(
        self,
        image: Path,
        progress: Optional[Callable[[int], None]],
        opened: Optional[list[tuple[img.FileEntry, int]]],
    ) -> None:
        try:
            if opened is None:
                img.verify(image, checksums=True, progress=progress)
            else:
                lazypages.verify_open_files(image, opened, progress, self._stop, threads=self._threads)
        except BaseException as exc:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self.done_at = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop hashing the page files (lazy restore: the tree was killed for another reason)."""
        self._stop.set()

    def join(self) -> Optional[BaseException]:
        self._thread.join()
        return self.error


def _device_files_verified(
    manifest: img.Manifest, device_checks: list[Checksums | devchunks.Assembly], cb: RestoreCallbacks
) -> Callable[[], None]:
    """What runs after each agent's Restore and before its Unlock (which writes the device
    memory back): wait for the device-memory files' checksums; on a mismatch kill the tree, whose
    device memory was never loaded, and raise (exit 8)."""
    lock = threading.Lock()
    killed: list[int] = []

    def wait() -> None:
        with lock:
            error = next((e for e in (c.join() for c in device_checks) if e is not None), None)
            if error is None:
                return
            if not killed:
                killed.extend(p.pid for p in manifest.processes)
                for pid in killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if isinstance(error, NpusnapError):
                    error.message += " (the restored tree was killed before its device memory was loaded)"
                    error.details["killed_before_device_memory"] = list(killed)
            raise error

    # No note: verifying alongside is how every restore runs (its phase table says so), not a
    # warning.
    return wait


def _stopped_in_image(st: RestoreState) -> set[int]:
    """The manifest's pids of the processes that were stopped when dumped (CRIU restores them
    stopped): releasing the tree must leave them so."""
    ids = set(_image_stops(st))
    if not st.manifest.pid_ns:
        return ids
    host = {ns: int(h) for h, ns in st.manifest.pid_ns.items()}
    return {host[i] for i in ids if i in host}


def _release_when_verified(
    manifest: img.Manifest, checksums: Checksums, cb: RestoreCallbacks, stays_stopped: set[int]
) -> None:
    """CRIU left the tree stopped: let it run if every checksum matched, else kill it unrun. A
    process stopped when it was dumped stays stopped, as CRIU restores it."""
    cb.phase("checksums")
    error = checksums.join()
    pids = [p.pid for p in manifest.processes]
    sig = signal.SIGKILL if error is not None else signal.SIGCONT
    for pid in pids:
        if sig == signal.SIGCONT and pid in stays_stopped:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if error is not None:
        if isinstance(error, NpusnapError):
            error.message += " (the restored tree was killed before it ran)"
            error.details["killed_unrun"] = pids
        raise error


def _check_none_left_locked(manifest: img.Manifest, root_pid: int, log: str) -> None:
    """A restored process with an agent that the manifest says has no device state must be
    RUNNING: one still locked means the manifest's ``npu`` flag lied (an edited image), and a
    restore that exits 0 must not leave a process BACKED_UP forever."""
    locked = []
    for p in manifest.processes:
        if p.npu or not p.agent:
            continue
        stop = procfs.stop_state(p.pid)
        if stop is not None and stop[1] == 0:
            continue  # restored stopped, as dumped: it runs no agent code (and was locked by no dump)
        try:
            with AgentClient(p.pid, connect_retry_s=1.0) as client:
                state = client.status().get("state")
        except NpusnapError:
            continue  # no agent to ask: nothing was locked through one
        if state not in (None, contract.SnapshotState.RUNNING.name):
            locked.append(p.pid)
    if locked:
        hint = " ; ".join(f"npusnap thaw --force {p}" for p in locked)
        raise DeviceError(
            f"CRIU restored the tree (root pid {root_pid}), but pid(s) {locked} came back locked although "
            "the manifest says they have no device state",
            why="the image's manifest was edited (its npu flags), or was written by a broken dump",
            fix=f"those processes stay locked; to run them anyway: {hint}; do not trust this image",
            details={"locked_pids": locked, "restored_root_pid": root_pid, "criu_restore_log": log},
        )


def writable_dir(path: Path, *, parents: bool) -> bool:
    try:
        path.mkdir(mode=img.DIR_MODE, parents=parents, exist_ok=True)
    except OSError:
        return False
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def restore_logs_dir(image: Path, wanted: Optional[Path], note: Callable[[str], None]) -> Path:
    """Where CRIU writes its restore log (and statistics).

    ``--logs DIR`` if given; else the image's ``logs/``; an image on read-only storage (a
    snapshot volume, a read-only mount) gets a new directory among the failure logs instead, so
    that restoring it needs no writable copy.
    """
    if wanted is not None:
        if not writable_dir(wanted, parents=True):
            raise UsageError(
                f"cannot write CRIU's restore log into {wanted}",
                why="--logs must be a directory npusnap can create or write to",
                fix="pass a writable directory to --logs",
            )
        return wanted
    inside = img.logs_dir(image)
    if writable_dir(inside, parents=False):
        return inside
    elsewhere = hostclean.new_log_dir("restore")
    note(f"the image is not writable: CRIU's restore log goes to {elsewhere}")
    return elsewhere


def _state_now(pid: int, group: Optional[DeviceGroup]) -> tuple[Optional[str], str]:
    """(state, who unlocked it) that ``pid``'s agent reports now; (None, "") if it cannot say
    within devicegroup.STATE_NOW_S. Asked over the group's own connection when it has one."""
    st = status_now(pid, group.clients.get(pid) if group is not None else None)
    if st is None:
        return None, ""
    events = " ".join(str(e) for e in st.get("events") or [])
    by = (
        "its agent's lease, which ran out meanwhile,"
        if "lease rollback done" in events
        else "another command"
    )
    state = st.get("state")
    return (str(state) if state is not None else None), by


def _strip_stay_locked(message: str) -> str:
    """The message without DeviceGroup's note that the failed pids stay locked."""
    head, sep, _tail = message.partition(" (pid(s) ")
    return head if sep else message


def _restore_and_unlock(
    npu_pids: tuple[int, ...],
    options: RestoreOptions,
    root_pid: int,
    log: str,
    tokens: dict[int, str],
    device_memory_files: dict[int, tuple[int, str]],
    before_unlock: Optional[Callable[[], None]] = None,
    guard: Optional[SignalGuard] = None,
) -> None:
    """Restore + Unlock each NPU process; ``device_memory_files``: pid -> (fd, name) of the
    image's device-memory file (the agent writes it back to the device after Unlock)."""
    group = None
    # A signal, or a restored process that stays stopped, ends the waits (restoreguard.py).
    wait = restoreguard.DeviceWait(npu_pids, guard)
    try:
        group = DeviceGroup(npu_pids, lease_s=options.lease_s, command="restore", interrupted=wait)
        # The restored agents still record the dump as their lock's owner: present its tokens.
        group.set_tokens(tokens)
        group.restore_and_unlock(device_memory_files, before_unlock)
    except ImageError:
        raise  # the device-memory files did not match: the tree was killed (before_unlock)
    except NpusnapError as first:
        err = restoreguard.after_failure(first, wait, npu_pids, root_pid)
        if err is not first:
            err.details.setdefault("criu_restore_log", log)
            if group is not None:
                group.hand_over(npu_pids)
            raise err from None
        err.details.setdefault("restored_root_pid", root_pid)
        err.details.setdefault("criu_restore_log", log)
        failed = err.details.get("failures") or {int(err.details.get("pid", npu_pids[0])): err.message}
        # What the agents say now, not what the failure suggests: a lease that ran out while this
        # restore was stopped (or slow) restored and unlocked its process by itself. Not asked
        # when the restore was told to stop: it answers at once, and its requests are in flight.
        now: dict[int, tuple[Optional[str], str]]
        if isinstance(err, InterruptedError_):
            now = {int(p): (None, "") for p in failed}
        else:
            now = {int(p): _state_now(int(p), group) for p in failed}
        running = sorted(p for p, (state, _by) in now.items() if state == contract.SnapshotState.RUNNING.name)
        locked = sorted(p for p in now if p not in running)
        err.details["locked_pids"] = locked
        err.details["running_pids"] = running
        if group is not None and locked:
            # The failed processes stay locked, owned by the dump's token: hand it to `thaw`.
            group.hand_over(locked)
        if "CRIU restored" not in err.message:
            err.message = (
                f"CRIU restored the tree (root pid {root_pid}), but the device restore failed: {err.message}"
            )
        if running:
            err.message = (
                _strip_stay_locked(err.message)
                + "; "
                + "; ".join(
                    f"pid {p} runs: {now[p][1]} restored its device state and unlocked it" for p in running
                )
            )
        if locked:
            hint = " ; ".join(f"npusnap status {p} ; npusnap thaw {p}" for p in locked)
            err.fix = (
                f"pid(s) {', '.join(map(str, locked))} stay locked, the others run. Look at them and "
                f"retry: {hint} (thaw restores the device state if needed, then unlocks)"
            )
        else:
            err.fix = (
                "nothing is left locked: "
                + " ; ".join(f"npusnap status {p}" for p in running)
                + (" shows it running; give the job a longer lease at dump (--lease) if the restore may wait")
            )
        raise
    finally:
        if group is not None:
            group.close()


def rebuild_communicators(npu_pids: tuple[int, ...], root_pid: int, note: Callable[[str], None]) -> None:
    """The job's HCCL communicators made anew behind its handles (device/hcclrebuild.py); the
    processes run already: their collectives wait for this."""
    try:
        hcclrebuild.rebuild(npu_pids, note)
    except NpusnapError as err:
        err.message = f"CRIU restored the tree (root pid {root_pid}) and it runs, but {err.message}"
        err.details.setdefault("restored_root_pid", root_pid)
        raise
