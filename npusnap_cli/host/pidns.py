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
finds a replica's socket by the inode it holds (paths.held_agent_socket).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.errors import DeviceError, PreflightError, TargetError, UsageError
from npusnap_cli.sim import wire


def ns_pids(pid: int) -> list[int]:
    """``NSpid`` of ``pid``: its pid in each pid namespace it is in, outermost (ours) first."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


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
    tag = secrets.token_hex(4)
    return {str(p.pid): f"{p.pid}-{tag}" for p in manifest.processes}


_NAME = re.compile(r"^(?P<dir>/.*/npusnap[^/]*)/(?P<pid>\d+)\.sock(?P<rest>(=00)?)$")


def criu_view(criu_dir: Path, manifest: Any) -> Path:
    """A directory CRIU can restore from: a symlink to each file of ``criu_dir`` but
    ``files.img``, rewritten so that each agent socket (``npusnap*/<pid>.sock`` of a process of
    the image) is bound under a name of its own. The caller removes it (``drop_view``)."""
    import pycriu

    renames = _agent_socket_names(manifest)
    agents = {p.agent_socket: str(p.pid) for p in manifest.processes if getattr(p, "agent_socket", None)}
    view = Path(tempfile.mkdtemp(prefix="npusnap-restore-view-"))
    try:
        for entry in os.scandir(criu_dir):
            if entry.name != "files.img":
                os.symlink(os.path.join(os.path.abspath(criu_dir), entry.name), view / entry.name)
        with open(criu_dir / "files.img", "rb") as f:
            files = pycriu.images.load(f)
        for e in files.get("entries", []):
            usk = e.get("usk") if e.get("type") == "UNIXSK" else None
            name = usk.get("name") if usk else None
            m = _NAME.match(name) if isinstance(name, str) else None
            if usk is not None and m and m.group("pid") in renames:
                usk["name"] = f"{m.group('dir')}/{renames[m.group('pid')]}.sock{m.group('rest')}"
            elif usk is not None and isinstance(name, str):
                # An agent socket in a runtime directory of another name (NPUSNAP_RUNTIME_DIR).
                bare = name[:-3] if name.endswith("=00") else name
                if bare in agents:
                    usk["name"] = f"{os.path.dirname(bare)}/{renames[agents[bare]]}.sock{name[len(bare) :]}"
        with open(view / "files.img", "wb") as f:
            pycriu.images.dump(files, f)
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


def check_device_map(manifest: Any, device_map: tuple[tuple[int, int], ...]) -> None:
    """Refuse a device map that cannot be made true for this image."""
    if not device_map:
        return
    if not manifest.pid_ns:
        raise UsageError(
            "--device-map needs an image of a job in its own pid namespace (`npusnap run --pid-ns`)",
            why="the map is set per pid namespace, as a container's device mapping is: a job "
            "restored into the host's would remap every other process's devices too",
            fix="start the job with `npusnap run --pid-ns`, dump it again, and restore that image",
        )
    if not manifest.versions.cann_simulated:
        raise PreflightError(
            "--device-map is only possible on the simulated NPU",
            why="CANN's Restore reopens the device id the process used; only the driver's view of "
            "which physical device that id is can change, and that is set when a container is "
            "created (ASCEND_VISIBLE_DEVICES / device mounts), not by a process outside it",
            fix="restore the replica inside a container that exposes the wanted physical device "
            "under the image's device id (docs/runbooks/replicas.md)",
        )
    used = {d for p in manifest.npu_processes for d in p.devices}
    unknown = sorted({a for a, _ in device_map} - used)
    if unknown:
        raise UsageError(
            f"--device-map names device(s) {unknown} that the image does not use (it uses {sorted(used)})",
            fix="map the image's own device ids (`npusnap inspect IMAGE` shows them)",
        )


def apply_device_map(root: int, device_map: tuple[tuple[int, int], ...]) -> None:
    """Tell the simulated driver that the restored namespace (init ``root``) sees each image
    device as the mapped one, before its runtime's Restore claims it."""
    try:
        ns = os.stat(f"/proc/{root}/ns/pid").st_ino
        with wire.connect(str(paths.sim_socket_path()), 5.0) as s:
            for dev, phys in device_map:
                status, _v, _p = wire.request(s, wire.OP_NSMAP, dev=dev, a=ns, b=phys, n=root)
                if status != 0:
                    raise OSError(-status, os.strerror(-status))
    except OSError as exc:
        raise DeviceError(
            f"cannot set the device map of the restored tree (root pid {root}): {exc}",
            why="the simulated NPU daemon refused or did not answer",
            fix=f"the tree is restored but locked; `kill {root}` and restore again",
        ) from None


# --------------------------------------------------------------------------------------------
# A copy's own output file
# --------------------------------------------------------------------------------------------


def output_file_of(criu_dir: Path, manifest: Any) -> Optional[str]:
    """The regular file the image's root process has as its stdout (fd 1), from CRIU's images
    (``ids-N.img`` -> ``fdinfo-<files_id>.img`` -> ``files.img``), or None."""
    import pycriu

    root = 1 if manifest.pid_ns else manifest.root_pid

    def load(name: str) -> list[dict[str, Any]]:
        with open(criu_dir / name, "rb") as f:
            return list(pycriu.images.load(f).get("entries", []))

    try:
        files_id = load(f"ids-{root}.img")[0]["files_id"]
        fd1 = next((e for e in load(f"fdinfo-{files_id}.img") if int(e.get("fd", -1)) == 1), None)
        if fd1 is None:
            return None
        entry = next(
            (e for e in load("files.img") if e.get("id") == fd1["id"] and e.get("type") == "REG"), None
        )
    except (OSError, KeyError, IndexError, ValueError):
        return None
    name = entry["reg"].get("name") if entry else None
    return name if isinstance(name, str) and name.startswith("/") else None


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
