"""Every check before anything is touched, in the restore's order (``CHECKS``, run by
``preflight``): the same CRIU and CANN, the pids and devices free, the agents' socket
directories, the host files, where CRIU's log goes. ``restore --dry-run`` runs the same table."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli import acl, criu
from npusnap_cli.device import occupancy
from npusnap_cli.errors import BusyError, IncompatibleImageError, PreflightError, UsageError
from npusnap_cli.host import hostclean, hostres, lazypages, pidns, procfs, qualifyreport
from npusnap_cli.host import pidfile as pidfile_mod
from npusnap_cli.image import integrity, layout
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.pipelines import checks
from npusnap_cli.pipelines.restore.options import RestoreOptions


def check_versions(manifest: Manifest, binary: criu.CriuBinary) -> Optional[acl.CannInstall]:
    """Same CRIU and CANN as at dump time (the device state format is the runtime's own); the
    CANN installation the device state will be restored with (None: no NPU process)."""
    v = manifest.versions
    if binary.version != v.criu:
        raise IncompatibleImageError(
            f"the image was dumped with CRIU {v.criu}, this host has CRIU {binary.version}",
            why="npusnap restores only with the CRIU version that dumped the image",
            fix=f"install CRIU {v.criu} (./scripts/setup.sh with NPUSNAP_CRIU_VERSION={v.criu}) "
            "or set NPUSNAP_CRIU to a matching binary",
        )
    if not manifest.npu_processes:
        return None
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
    return cann


def check_device_memory(manifest: Manifest, accept_lost: bool) -> Optional[str]:
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


def image_thread_ids(image: Path, manifest: Manifest) -> list[int]:
    """Every pid and thread id CRIU will recreate; the image's processes must be the manifest's
    (the check `npusnap verify` and the dump make too)."""
    return integrity.check_process_tree(image, manifest)


def check_pids_free(manifest: Manifest, ids: Optional[list[int]] = None) -> None:
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
    manifest: Manifest,
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


def device_users(manifest: Manifest) -> list[occupancy.DeviceUse]:
    """The NPU processes a restore of ``manifest`` must not share a device with (``users`` of
    check_devices_free: one look for several checks)."""
    # Without a pid namespace of its own an image pid in use is the pid check's (the original,
    # usually); with one, the original keeps its host pids and is just another process here.
    image_pids = frozenset() if manifest.pid_ns else frozenset(p.pid for p in manifest.processes)
    v = manifest.versions
    return occupancy.device_users(v.cann_home, bool(v.cann_simulated), image_pids)


def prepare_sockets(manifest: Manifest) -> None:
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
    manifest: Manifest
    options: RestoreOptions
    dry_run: bool = False
    binary: Optional[criu.CriuBinary] = None
    cann: Optional[acl.CannInstall] = None  # the versions check's: the device state's CANN
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
    pf.cann = check_versions(pf.manifest, binary)
    v = pf.manifest.versions
    return f"CRIU {binary.version}" + (f", CANN {v.cann}" if pf.manifest.npu_processes else "")


def _qualified(pf: Preflight) -> str:
    """The node's qualification report for the CANN the restore runs the device state with."""
    assert pf.cann is not None  # skipped without it
    return qualifyreport.gate(pf.cann, pf.tell)


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
    paths = hostres.check_listeners_free(layout.criu_dir(pf.image), agents)
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
        return f"CRIU's log -> {pf.logs / layout.RESTORE_LOG}"
    if wanted is not None:
        if not writable_dir(wanted, parents=True):
            raise UsageError(f"cannot write CRIU's restore log into {wanted}", fix="pass a writable --logs")
        return f"CRIU's log -> {wanted}"
    inside = layout.logs_dir(pf.image)
    if writable_dir(inside, parents=False):
        return f"CRIU's log -> {inside / layout.RESTORE_LOG}"
    return "the image is not writable: CRIU's log would go under $TMPDIR/npusnap-logs"


def _pidfile(pf: Preflight) -> str:
    assert pf.options.pidfile is not None  # skipped without --pidfile
    pidfile_mod.check(pf.options.pidfile)
    return f"-> {pf.options.pidfile}"


# In the restore's order; ``restore --dry-run`` runs the image's structure and checksums first.
CHECKS: tuple[Check, ...] = (
    Check("versions", "same CRIU and CANN as at dump time", _versions),
    Check(
        "qualified",
        "the node's qualification report (npusnap qualify)",
        _qualified,
        skip=lambda pf: (
            "no NPU process"
            if not pf.manifest.npu_processes
            else None
            if pf.cann is not None
            else "needs the CANN the versions check finds"
        ),
    ),
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
    manifest: Manifest,
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


def writable_dir(path: Path, *, parents: bool) -> bool:
    try:
        path.mkdir(mode=layout.DIR_MODE, parents=parents, exist_ok=True)
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
    inside = layout.logs_dir(image)
    if writable_dir(inside, parents=False):
        return inside
    elsewhere = hostclean.new_log_dir("restore")
    note(f"the image is not writable: CRIU's restore log goes to {elsewhere}")
    return elsewhere
