"""What CRIU, or the image's own restore, would refuse about the tree or the host: found before
anything is locked, each raising the error the dump would otherwise meet later."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from npusnap_cli import acl, criu
from npusnap_cli.errors import PreflightError
from npusnap_cli.host import criuplugin, hostres, pidns, preflight, procfs, tcpunlock
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.image import layout
from npusnap_cli.pipelines.callbacks import PhaseFn
from npusnap_cli.pipelines.dump.options import DumpOptions
from npusnap_cli.pipelines.dump.target import _mem_available, _our_mount_ns
from npusnap_cli.units import human_bytes

# Headroom on top of the expected image size: CRIU's own metadata, the manifest, filesystem slack.
SPACE_MARGIN_BYTES = 16 << 20
SPACE_MARGIN_FACTOR = 1.10


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
    where its owner could not have made it (a root job's lock in a root directory) passes while
    it is there (restore leaves such a file in place; it never writes it there as root)."""
    pids = [p.pid for p in tree if not p.zombie]
    paths = _host_file_paths(pids, options.criu.file_locks)
    if not paths:
        return
    files = hostres.planned_files(paths)
    ours = _our_mount_ns(tree[0].pid) or pidns.in_device_view(tree[0].pid)
    nodes = hostres.find_host_nodes(pids, paths) if ours else []
    uids = {p.uid if p.uid is not None else -1 for p in tree}
    problems = hostres.check_host_files(files, uids, nodes) + hostres.leases_unreadable(paths)
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
    have = layout.free_bytes(final.parent)
    if have < need:
        layout.check_dump_target(final, force=True)  # a read-only filesystem: name that, not "0 B free"
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
