"""Jobs that are init of their own pid namespace (`npusnap run --pid-ns`).

CRIU dumps such a tree with the pids its processes have *inside* the namespace (``pstree.img``)
and restores it into a new pid namespace: the restore needs no host pid free, so an image
restores beside its still-running original, and as often as wanted. The CLI works with host
pids throughout; ``/proc/PID/status`` (``NSpid:``, outermost first) maps one to the other:

* at dump, ``namespace_pids`` records host pid -> namespace pid for every process (manifest
  ``pid_ns``);
* at restore, ``translate`` rewrites the manifest's pids to the restored processes' host pids,
  found under the restored root by their namespace pids.

The agent of each process names its socket after its host pid (native/agent/core.c reads it from
/proc/self, which `--pid-ns` keeps the host's). CRIU binds a restored socket at its dumped path,
removing a socket file already there: restored beside the original, the copy would take the
original's name. ``criu_view`` therefore gives each restore a view of the CRIU image (symlinks)
in which the agents' sockets are bound under names of their own (``<pid>-<tag>.sock``); the CLI
finds a replica's socket by the inode it holds (paths.held_agent_socket). A dump of such a copy
records that name as its agent's socket (``paths.COPY_SOCKET_NAME``), and its restore renames it
again: a chain of restores and dumps keeps working.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criuimages, paths
from npusnap_cli.device import occupancy
from npusnap_cli.errors import DeviceError, PreflightError, TargetError, UsageError
from npusnap_cli.host.procfs import ns_pids


def _ns(pid: int | str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def namespace_pids(root: int, tree: list[int]) -> dict[int, int]:
    """Host pid -> namespace pid for each process of a tree whose root is init (pid 1) of a pid
    namespace of its own; {} for any other tree (CRIU then restores the host pids)."""
    nested = ns_pids(root)
    if len(nested) < 2 or nested[-1] != 1 or _ns(root) == _ns("self"):
        return {}
    out = {}
    for pid in tree:
        inner = ns_pids(pid)
        if len(inner) != len(nested) or _ns(pid) != _ns(root):
            raise TargetError(
                f"pid {pid} of the tree is not in the pid namespace of its root {root}",
                why="CRIU dumps one pid namespace per tree: a process in a nested or foreign one "
                "cannot be restored",
                fix="dump the tree rooted at that process's own namespace init",
            )
        out[pid] = inner[-1]
    return out


def check_job_cwds(roots: list[int]) -> None:
    """Refuse a job in which processes of two ranks, each in a pid namespace of its own, share a
    working directory. CRIU's parasite finds no /proc of such a process's namespace (the host's
    is kept), so it mounts one at ``proc.crtools`` in the process's working directory
    (criu/pie/parasite.c, get_proc_fd); the ranks' CRIUs run at once, and the second mkdir there
    fails the dump with "Can't create a directory (-17)" (EEXIST) after the job was locked."""
    import psutil

    seen: dict[str, tuple[int, int]] = {}  # cwd -> (rank, pid)
    for rank, root in enumerate(roots):
        if not namespace_pids(root, [root]):
            continue  # in our pid namespace: CRIU's parasite opens /proc itself
        try:
            procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.Error:
            continue  # resolve_target names a missing pid
        for proc in procs:
            try:
                cwd = proc.cwd()
            except psutil.Error:
                continue
            other = seen.setdefault(cwd, (rank, proc.pid))
            if other[0] != rank:
                raise PreflightError(
                    f"pid {proc.pid} (rank {rank}) and pid {other[1]} (rank {other[0]}) both run "
                    f"in {cwd}, each in a pid namespace of its own",
                    why="CRIU mounts the /proc of such a process at proc.crtools in its working "
                    "directory while it dumps it; the ranks are dumped at once, and two mounts "
                    "at one path fail the dump",
                    fix="start each rank in a working directory of its own "
                    "(cd DIR && npusnap run --pid-ns ...)",
                    details={"cwd": cwd, "pids": [other[1], proc.pid], "ranks": [other[0], rank]},
                )


def _agent_socket_names(manifest: Any) -> dict[str, str]:
    """Old bound name -> new one, for each agent socket of the image's processes."""
    tag = secrets.token_hex(paths.COPY_SOCKET_TAG_HEX // 2)
    return {str(p.pid): paths.copy_socket_stem(p.pid, tag) for p in manifest.processes}


_NAME = re.compile(r"^(?P<dir>/.*/npusnap[^/]*)/(?P<pid>\d+)\.sock$")


def criu_view(criu_dir: Path, manifest: Any) -> Path:
    """A directory CRIU can restore from: a symlink to each file of ``criu_dir`` but
    ``files.img``, rewritten so that each agent socket (``npusnap*/<pid>.sock`` of a process of
    the image) is bound under a name of its own. The caller removes it (``drop_view``)."""
    renames = _agent_socket_names(manifest)
    agents = {p.agent_socket: str(p.pid) for p in manifest.processes if getattr(p, "agent_socket", None)}

    def rename(name: bytes) -> Optional[bytes]:
        nul = b"\0" if name.endswith(b"\0") else b""
        bare = os.fsdecode(name[: len(name) - len(nul)])
        m = _NAME.match(bare)
        if m and m.group("pid") in renames:
            return os.fsencode(f"{m.group('dir')}/{renames[m.group('pid')]}.sock") + nul
        if bare in agents:
            # An agent socket in a runtime directory of another name (NPUSNAP_RUNTIME_DIR).
            return os.fsencode(f"{os.path.dirname(bare)}/{renames[agents[bare]]}.sock") + nul
        return None

    view = Path(tempfile.mkdtemp(prefix="npusnap-restore-view-"))
    try:
        for entry in os.scandir(criu_dir):
            if entry.name != "files.img":
                os.symlink(os.path.join(os.path.abspath(criu_dir), entry.name), view / entry.name)
        criuimages.rename_unix_sockets(criu_dir, view / "files.img", rename)
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def drop_view(view: Path) -> None:
    shutil.rmtree(view, ignore_errors=True)


def restored_pids(root: int) -> dict[int, int]:
    """Namespace pid -> host pid of the processes of the pid namespace whose init is ``root``."""
    import psutil

    out = {1: root}
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        kids = []
    for k in kids:
        inner = ns_pids(k.pid)
        if inner and _ns(k.pid) == _ns(root):
            out[inner[-1]] = k.pid
    return out


def translate(manifest: Any, root: int) -> tuple[Any, dict[int, int]]:
    """The manifest with each process's pid/ppid as the restored copy's host pid, and the map
    old host pid -> new host pid."""
    by_ns = restored_pids(root)
    old_to_new: dict[int, int] = {}
    for host, inner in manifest.pid_ns.items():
        if inner not in by_ns:
            raise TargetError(
                f"the restored namespace (init {root}) has no process {inner} (pid {host} at dump)",
                why="a process exited right after CRIU resumed it, or the image is inconsistent",
                fix=f"look at the restored tree (`ps --ppid {root}`) and CRIU's restore log",
            )
        old_to_new[int(host)] = by_ns[inner]
    procs = tuple(
        replace(p, pid=old_to_new[p.pid], ppid=old_to_new.get(p.ppid, p.ppid)) for p in manifest.processes
    )
    new_map = {str(old_to_new[int(h)]): v for h, v in manifest.pid_ns.items()}
    return replace(manifest, processes=procs, root_pid=root, pid_ns=new_map), old_to_new


# --------------------------------------------------------------------------------------------
# Restoring onto other device ids
# --------------------------------------------------------------------------------------------


def parse_device_map(spec: str) -> tuple[tuple[int, int], ...]:
    """``"0=1"`` or ``"0=1,1=3"`` (device id in the image = device to restore onto)."""
    pairs = []
    for part in spec.split(","):
        left, sep, right = part.strip().partition("=")
        if not sep or not left.strip().isdigit() or not right.strip().isdigit():
            raise UsageError(
                f"bad --device-map {spec!r}",
                fix="write it as IMAGE_DEVICE=DEVICE[,IMAGE_DEVICE=DEVICE...], e.g. --device-map 0=1",
            )
        pairs.append((int(left), int(right)))
    if len({a for a, _ in pairs}) != len(pairs):
        raise UsageError(f"--device-map {spec!r} maps a device twice", fix="name each image device once")
    return tuple(pairs)


def container_devices(manifest: Any, device_map: tuple[tuple[int, int], ...]) -> list[int]:
    """The devices a container must hold so that each image device id reaches its mapped device:
    the driver numbers a container's devices from 0 in physical order, so image devices 0..n-1 map
    onto n devices in ascending order (anything else cannot be made true by any container)."""
    used = sorted({d for p in manifest.npu_processes for d in p.devices})
    moved = dict(device_map)
    unknown = sorted(set(moved) - set(used))
    if unknown:
        raise UsageError(
            f"--device-map names device(s) {unknown} that the image does not use (it uses {used})",
            fix="map the image's own device ids (`npusnap inspect IMAGE` shows them)",
        )
    wanted = [moved.get(d, d) for d in range(max(used) + 1)] if used else []
    if sorted(set(wanted)) != wanted:
        raise UsageError(
            f"--device-map {','.join(f'{a}={b}' for a, b in device_map)} cannot be made true: the "
            f"image's devices 0..{len(wanted) - 1} would reach {wanted}",
            why="a container's devices are numbered from 0 in physical order (the driver numbers "
            "the device nodes the container holds), so the image's device ids 0, 1, ... reach "
            "distinct devices in ascending order",
            fix="map every device id below the image's highest one, onto ascending devices, e.g. "
            "--device-map 0=2,1=3",
        )
    node = occupancy.node_devices(simulated=True)
    missing = sorted(set(wanted) - set(node)) if node is not None else []
    if missing:
        # Caught here, before anything is touched: the container would hold a node of no device,
        # CRIU would restore the copy, and its Restore would fail with the copy left locked.
        raise UsageError(
            f"--device-map {','.join(f'{a}={b}' for a, b in device_map)} names device(s) {missing}, "
            f"which this node does not have (its devices: {', '.join(map(str, node or [])) or 'none'})",
            fix="map onto devices of this node (`npusnap sim status` lists them)",
            details={"missing_devices": missing, "node_devices": node},
        )
    return wanted


def refuse_on_real_cann(manifest: Any, option: str) -> None:
    """Moving a job's device ids (``--device-map``, and so ``--replicas`` of an NPU job) needs the
    simulated NPU's container of devices: refuse it, saying why, for an image of a real CANN."""
    if manifest.versions.cann_simulated:
        return
    raise PreflightError(
        f"{option} is only possible on the simulated NPU",
        why="CANN's Restore reopens the device id the process used; which physical device that "
        "id reaches is the container's (the device nodes it holds: ASCEND_VISIBLE_DEVICES "
        "under Ascend Docker Runtime, or --device /dev/davinciN), and npusnap does not create "
        "containers on a real node",
        fix="restore the image inside a container that holds the wanted device, one container "
        'per copy (docs/runbooks/replicas.md, "On a real node")',
        details={"option": option, "cann": manifest.versions.cann},
    )


def check_device_map(manifest: Any, device_map: tuple[tuple[int, int], ...]) -> None:
    """Refuse a device map that cannot be made true for this image."""
    if not device_map:
        return
    refuse_on_real_cann(manifest, "--device-map")
    listed = sorted({p.visible_devices for p in manifest.npu_processes if p.visible_devices is not None})
    if listed:
        raise PreflightError(
            f"--device-map cannot move this job: it ran with ASCEND_RT_VISIBLE_DEVICES={listed[0]}",
            why="the runtime read that list when it started and keeps it in the job's memory, so a "
            "restored copy still asks the driver for the devices the list names, which the container "
            "--device-map makes does not hold: its Restore would fail (507909) and leave it locked",
            fix="restore without --device-map (the image's devices must be free), or start such jobs "
            "without ASCEND_RT_VISIBLE_DEVICES and give each its device through its container",
            details={"visible_devices": listed},
        )
    container_devices(manifest, device_map)


def enter_device_view(manifest: Any, device_map: tuple[tuple[int, int], ...]) -> list[int]:
    """Make the calling thread, and every process it starts from now on (CRIU, and so the
    restored tree), live in a container of the simulated NPU that holds the mapped devices: a
    mount namespace of its own in which the simulator's device-node directory holds only their
    nodes, so the driver numbers them 0, 1, ... as the image's device ids. What a container
    runtime does on a node with the container's /dev (docs/simulator.md). Returns the devices."""
    wanted = container_devices(manifest, device_map)
    nodes = paths.sim_dev_dir(str(paths.sim_socket_path()))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]

    def fail(what: str) -> DeviceError:
        err = ctypes.get_errno()
        return DeviceError(
            f"cannot give the restore a container of the simulated NPU: {what}: {os.strerror(err)}",
            why="a mount namespace (unshare, mount) needs CAP_SYS_ADMIN",
            fix="run `npusnap restore --device-map` as root; nothing was restored",
        )

    if not os.path.isdir(nodes):
        raise DeviceError(
            f"the simulated NPU has no device nodes at {nodes}",
            why="the daemon makes them at start; this one is older or not running",
            fix="restart the simulator: `npusnap sim stop && npusnap sim start`",
        )
    if libc.unshare(CLONE_NEWNS) != 0:
        raise fail("unshare(CLONE_NEWNS)")
    # Private, so that the view's mount stays in this namespace instead of reaching the host.
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise fail("making / private")
    if libc.mount(_VIEW_SOURCE.encode(), nodes.encode(), b"tmpfs", 0, b"mode=0755,size=64k") != 0:
        raise fail(f"mounting {nodes}")
    for d in wanted:
        with open(os.path.join(nodes, f"davinci{d}"), "x"):
            pass
    return wanted


def in_device_view(pid: int) -> bool:
    """``pid`` lives in a container of the simulated NPU that `restore --device-map` made
    (``enter_device_view``): a mount namespace that differs from the host's by the tmpfs over
    the simulator's device-node directory only. A dump runs CRIU in it, so that the image holds no
    mount namespace (which a restore could not rebuild) and restores like any other."""
    try:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return False
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                _left, _, right = line.partition(" - ")
                fields = right.split()
                if len(fields) >= 2 and fields[0] == "tmpfs" and fields[1] == _VIEW_SOURCE:
                    return True
    except OSError:
        pass
    return False


_VIEW_SOURCE = "npusim-dev"  # the source name of the view's tmpfs (enter_device_view)
CLONE_NEWNS = 0x00020000  # include/uapi/linux/sched.h
MS_REC = 0x4000  # include/uapi/linux/mount.h
MS_PRIVATE = 1 << 18


# --------------------------------------------------------------------------------------------
# A copy's own output file
# --------------------------------------------------------------------------------------------


def output_file_of(criu_dir: Path, manifest: Any) -> Optional[str]:
    """The regular file the image's root process has as its stdout (fd 1), from CRIU's images
    (``ids-N.img`` -> ``fdinfo-<files_id>.img`` -> ``files.img``), or None."""
    root = 1 if manifest.pid_ns else manifest.root_pid
    try:
        ids = criuimages.ids(criu_dir, root)
        if ids is None:
            return None
        fd1 = next((e for e in criuimages.fdinfo(criu_dir, ids.files_id) if e.fd == 1), None)
        if fd1 is None:
            return None
        entry = next((f for f in criuimages.files(criu_dir) if f.id == fd1.id and f.type == "REG"), None)
    except OSError:
        return None
    name = entry.reg.name if entry and entry.reg else None
    return name if name is not None and name.startswith("/") else None


def open_output_target(criu_dir: Path, manifest: Any, output: Optional[Path]) -> list[tuple[str, int]]:
    """(CRIU key, fd) handing the restored job ``output`` (opened for appending) wherever it had
    its stdout file open (stdout and stderr, usually): CRIU's --inherit-fd for a regular file."""
    if output is None:
        return []
    name = output_file_of(criu_dir, manifest)
    if name is None:
        raise PreflightError(
            "--output: the image's root process has no regular file as its standard output",
            why="only a job writing to a file can be given another file (a pipe: --pipe-to)",
            fix="drop --output",
        )
    try:
        fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PreflightError(
            f"cannot open --output {output}: {exc.strerror}",
            fix="name a writable file (not a symlink) for the job's output",
        ) from None
    return [(name[1:], fd)]  # CRIU names a regular file by its path without the leading /
