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

Core module: returns a frozen dataclass, never prints.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import image as img
from npusnap_cli.callbacks import PipelineCallbacks
from npusnap_cli.errors import ImageError, NpusnapError, PreflightError

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
RestoreCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class RestoreOptions:
    verify: bool = True  # sha256 of every file (structure and sizes are always checked)
    pidfile: Optional[Path] = None
    lease_s: Optional[float] = None
    accept_lost_device_memory: bool = False  # restore a --device-memory discard image anyway


@dataclass(frozen=True)
class RestoreTimings:
    verify_s: float
    criu_restore_s: float
    criu_forking_s: Optional[float]
    criu_restore_only_s: Optional[float]
    device_restore_s: float
    total_s: float

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
        }


# --------------------------------------------------------------------------------------------
# Checks before anything is touched
# --------------------------------------------------------------------------------------------


def check_versions(manifest: img.Manifest, binary: Any) -> None:
    """Same CRIU and CANN as at dump time (the device state format is the runtime's own)."""
    from npusnap_cli import acl

    v = manifest.versions
    if binary.version != v.criu:
        raise ImageError(
            f"the image was dumped with CRIU {v.criu}, this host has CRIU {binary.version}",
            why="npusnap restores only with the CRIU version that dumped the image",
            fix=f"install CRIU {v.criu} (./scripts/setup.sh with NPUSNAP_CRIU_VERSION={v.criu}) "
            "or set NPUSNAP_CRIU to a matching binary",
        )
    if not manifest.npu_processes:
        return
    try:
        cann = acl.find_cann()
    except acl.CannNotFound as exc:
        raise PreflightError(
            f"no CANN installation to restore the device state with: {exc}",
            why=getattr(exc, "hint", ""),
            fix='source your CANN set_env.sh (or, for the simulator: eval "$(npusnap sim env)")',
        ) from None
    if cann.simulated != v.cann_simulated or (v.cann and cann.version != v.cann):
        have = f"{cann.version}{' (simulated)' if cann.simulated else ''}"
        want = f"{v.cann}{' (simulated)' if v.cann_simulated else ''}"
        raise ImageError(
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
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return cmd[:80] or "?"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


# A killed tree's processes stay zombies until their new parent (init) reaps them: briefly.
ZOMBIE_WAIT_S = 5.0


def check_pids_free(manifest: img.Manifest) -> None:
    """CRIU restores every process with its original pid: all of them must be free."""
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while True:
        taken = [p.pid for p in manifest.processes if os.path.exists(f"/proc/{p.pid}")]
        if not taken or not all(_zombie(p) for p in taken) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if taken:
        who = "; ".join(f"{pid}: {'a zombie' if _zombie(pid) else _proc_desc(pid)}" for pid in taken)
        original = manifest.leave_running or taken == [manifest.root_pid]
        raise PreflightError(
            f"pid(s) {', '.join(map(str, taken))} of the image are in use ({who})",
            why="CRIU restores processes with their original pids"
            + (" — the original process is probably still running" if original else ""),
            fix=f"stop the process(es) using them (e.g. `kill {taken[0]}` if it is the original), "
            "then restore again",
            details={"pids_in_use": taken},
        )


def check_devices_free(manifest: img.Manifest) -> None:
    """Restore claims the same device ids; refuse when another live process holds one."""
    if not manifest.versions.cann_simulated:
        # Real hardware: the runtime's Restore itself refuses an occupied device (507909) and the
        # process then stays locked; there is no driver query we can make from here.
        return
    from npusnap_cli import dump

    status = dump.sim_status()
    if status is None:
        raise PreflightError(
            "the simulated NPU daemon does not answer",
            why="the image was made on the simulated NPU and its devices must be free to restore it",
            fix='start it with `npusnap sim start` (and eval "$(npusnap sim env)")',
        )
    wanted = {d: p.pid for p in manifest.npu_processes for d in p.devices}
    busy = []
    known = set()
    for dev in status.get("devices", []):
        known.add(int(dev.get("id", -1)))
        # Devices are shared, but CANN's Restore needs its device free of every other process.
        owners = dev.get("owners") or ([dev["owner"]] if dev.get("owner") else [])
        for owner in owners:
            if int(dev.get("id", -1)) in wanted and owner and owner.get("alive"):
                busy.append((int(dev["id"]), int(owner["pid"])))
    if busy:
        text = ", ".join(f"device {d} by pid {o} ({_proc_desc(o)})" for d, o in busy)
        raise PreflightError(
            f"device(s) of the image are occupied: {text}",
            why="the device state is restored onto the same device id, which must be free",
            fix=f"stop pid {busy[0][1]} (or wait for it to finish), then restore again",
            details={"busy": [{"device": d, "pid": o} for d, o in busy]},
        )
    missing = sorted(d for d in wanted if d not in known)
    if missing:
        raise PreflightError(
            f"device(s) {missing} of the image do not exist on this host",
            why=f"the simulated NPU has devices {sorted(known)}",
            fix="start the simulator with enough devices (`npusnap sim stop; npusnap sim start --devices N`)",
        )


def prepare_sockets(manifest: img.Manifest) -> None:
    """Create each agent socket's directory (0700) and refuse what CRIU would trip over."""
    for p in manifest.processes:
        if not p.agent_socket:
            continue
        sock = Path(p.agent_socket)
        parent = sock.parent
        try:
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise PreflightError(
                f"cannot create the agent socket directory {parent}: {exc.strerror}",
                fix="create it (mode 0700) or run as the image's user/root",
            ) from None
        st = parent.lstat()
        if not stat.S_ISDIR(st.st_mode):
            raise PreflightError(f"{parent} is not a directory", fix=f"remove it: rm {parent}")
        with contextlib.suppress(FileNotFoundError):
            sst = sock.lstat()
            if not stat.S_ISSOCK(sst.st_mode):
                raise PreflightError(
                    f"{sock} exists and is not a socket",
                    why="CRIU restores the agent's listening socket at that path",
                    fix=f"remove it: rm {sock}",
                )


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


def _criu_options(manifest: img.Manifest) -> Any:
    from npusnap_cli import criu

    o = manifest.criu_options
    return criu.CriuOptions(
        tcp_established=bool(o.get("tcp_established")),
        shell_job=bool(o.get("shell_job")),
        file_locks=bool(o.get("file_locks")),
        ext_unix_sk=bool(o.get("ext_unix_sk")),
        external=tuple(str(x) for x in o.get("external") or ()),
    )


def restore(
    directory: Path,
    options: RestoreOptions = RestoreOptions(),
    callbacks: RestoreCallbacks = RestoreCallbacks(),
) -> RestoreOutcome:
    """Run the whole restore pipeline (see the module docstring); raise NpusnapError on failure."""
    from npusnap_cli.dump import SignalGuard

    # A signal before CRIU starts stops the restore with nothing touched; once CRIU has started,
    # stopping halfway would leave processes locked with nobody to restore them, so it finishes.
    with SignalGuard(callbacks.note, what="restore") as guard:
        return _restore(directory, options, callbacks, guard)


def _restore(
    directory: Path, options: RestoreOptions, callbacks: RestoreCallbacks, guard: Any
) -> RestoreOutcome:
    from npusnap_cli import criu

    start = time.monotonic()
    cb = callbacks
    final = Path(os.path.abspath(directory))
    cb.phase("verify")
    manifest = img.load_manifest(final)
    total = sum(f.size for f in manifest.files)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        cb.progress("verifying", done[0], total)

    img.verify(final, checksums=options.verify, progress=advance)
    binary = criu.find_criu()
    check_versions(manifest, binary)
    device_memory = check_device_memory(manifest, options.accept_lost_device_memory)
    check_pids_free(manifest)
    check_devices_free(manifest)
    prepare_sockets(manifest)
    logs = img.logs_dir(final)
    try:
        logs.mkdir(mode=img.DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ImageError(
            f"cannot create {logs} for CRIU's restore log: {exc.strerror}",
            why="CRIU always writes a log, and npusnap keeps it in the image's logs/ directory",
            fix="restore from a writable copy of the image",
        ) from None
    verify_s = time.monotonic() - start
    guard.check("before anything was started", "nothing was restored")

    cb.phase("criu restore")
    res = criu.restore(
        str(img.criu_dir(final)),
        str(logs),
        options=_criu_options(manifest),
        log_name=img.RESTORE_LOG,
        binary=binary,
    )
    criu_done = time.monotonic()
    root_pid = res.pid
    npu_pids = tuple(p.pid for p in manifest.npu_processes)
    pidfile: Optional[str] = None
    if options.pidfile is not None:
        # Written before the device step: if that fails the tree is running (locked), and the
        # operator's scripts need its pid all the same.
        pidfile = _write_pidfile(options.pidfile, root_pid)

    cb.phase("device restore")
    if npu_pids:
        _device_restore(npu_pids, options, root_pid, res.log_path)
    device_done = time.monotonic()
    if guard.received is not None:
        cb.note(f"{guard.name} was received during the restore; the restore was completed first")
    stats = res.stats
    timings = RestoreTimings(
        verify_s=verify_s,
        criu_restore_s=criu_done - start - verify_s,
        criu_forking_s=stats.forking_time_us * 1e-6 if stats else None,
        criu_restore_only_s=stats.restore_time_us * 1e-6 if stats else None,
        device_restore_s=device_done - criu_done,
        total_s=device_done - start,
    )
    return RestoreOutcome(
        image=str(final),
        root_pid=root_pid,
        pids=tuple(p.pid for p in manifest.processes),
        npu_pids=npu_pids,
        timings=timings,
        criu_log=res.log_path,
        pidfile=pidfile,
        device_memory=device_memory,
    )


def _write_pidfile(path: Path, pid: int) -> str:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(f"{pid}\n", encoding="ascii")
        os.replace(tmp, path)
    except OSError as exc:
        raise ImageError(
            f"restored pid {pid}, but could not write the pidfile {path}: {exc.strerror}",
            fix=f"the process runs; its pid is {pid}",
        ) from None
    return str(path)


def _device_restore(npu_pids: tuple[int, ...], options: RestoreOptions, root_pid: int, log: str) -> None:
    from npusnap_cli.devicegroup import DeviceGroup

    group = None
    try:
        group = DeviceGroup(npu_pids, lease_s=options.lease_s)
        group.restore_and_unlock()
    except NpusnapError as err:
        err.details.setdefault("restored_root_pid", root_pid)
        err.details.setdefault("criu_restore_log", log)
        failed = err.details.get("failures") or {int(err.details.get("pid", npu_pids[0])): err.message}
        err.details["locked_pids"] = sorted(int(p) for p in failed)
        if "CRIU restored" not in err.message:
            err.message = (
                f"CRIU restored the tree (root pid {root_pid}), but the device restore failed: {err.message}"
            )
        hint = " ; ".join(f"npusnap status {p} ; npusnap thaw {p}" for p in err.details["locked_pids"])
        err.fix = (
            f"the failed process(es) stay locked, the others run. Look at them and retry: {hint} "
            "(thaw restores the device state if needed, then unlocks)"
        )
        raise
    finally:
        if group is not None:
            group.close()
