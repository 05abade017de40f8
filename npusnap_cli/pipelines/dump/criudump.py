"""The CRIU step: the tree dumped and left stopped, what CRIU saved checked against what the dump
locked, the host files saved while the tree is frozen; its undo lets the tree run again."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from npusnap_cli import criu
from npusnap_cli.device.leasekeeper import LeaseKeeper, keeping
from npusnap_cli.errors import CriuError, ImageError, StateUnknownError, TargetError
from npusnap_cli.host import agentrecord, criuplugin, hostres, pidns, proctree, tcpunlock
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.image import integrity, layout
from npusnap_cli.image.streamhash import StreamHasher
from npusnap_cli.pipelines.dump.agents import _announce_rollback
from npusnap_cli.pipelines.dump.devmemory import _hash_device_files
from npusnap_cli.pipelines.dump.manifest import _devices
from npusnap_cli.pipelines.dump.state import DumpState, _sampling
from npusnap_cli.pipelines.dump.target import _our_mount_ns, _rss
from npusnap_cli.pipelines.dump.treechecks import _host_file_paths, _simulated_npu_pids


def _criu(s: DumpState) -> None:
    try:
        _criu_dump(s)
    except BaseException as exc:
        _resume(s, exc)  # a step that fails cleans up after itself: CRIU may have stopped the tree
        raise


def _criu_dump(s: DumpState) -> None:
    s.group.close()  # CRIU refuses connected stream sockets whose peer is outside the tree
    # Knows, until the kill, whether every lock is still the dump's (leasekeeper.py).
    lease = s.locked.lease = LeaseKeeper(s.locked.lock_tokens, s.options.lease_s)
    lease.renew_or_fail("before CRIU started")
    tmp = s.work
    s.saved.criu_options = s.options.criu_for(s.target.tree, s.resolved.tcp_within)
    expected = sum(_rss(p.pid) for p in s.target.tree)
    # Checksums are computed while CRIU writes, off the critical path (streamhash.py).
    hasher = s.saved.hasher = StreamHasher(layout.criu_dir(tmp)).start()
    try:
        start = time.monotonic()
        with (
            keeping(lease, [p.pid for p in s.target.tree]),
            _sampling(
                lambda: layout.tree_size(layout.criu_dir(tmp)),
                lambda n: s.cb.progress("writing image", n, max(expected, n)),
            ),
        ):
            s.saved.criu_result = criu.dump(
                s.target.root_pid,
                str(layout.criu_dir(tmp)),
                str(layout.logs_dir(tmp)),
                options=s.saved.criu_options,
                log_name=layout.DUMP_LOG,
                binary=s.binary,
                on_notify=lambda script, pid: _on_criu_notify(s, script, pid),
                in_mount_ns=s.resolved.device_view,
            )
        s.saved.criu_s = time.monotonic() - start
    except OSError as exc:
        hasher.stop()
        raise ImageError(
            f"CRIU could not be started, or a file of the image could not be written: {exc}"
        ) from None
    except BaseException:
        hasher.stop()
        lease.check("while CRIU ran")  # a lost lock is the cause to report
        raise
    s.saved.criu_done = s.saved.frozen_end = time.monotonic()
    _hash_device_files(s, criu_done=True)
    if not s.options.leave_running:
        # The tree is stopped (leave_stopped): it is killed only after the image is published.
        s.saved.stopped_pids = proctree.tree_pids(s.target.root_pid)
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
    entries = integrity.read_pstree(layout.criu_dir(s.work))
    if entries is None:
        return  # not CRIU's doing: publishing's verification refuses the image
    dumped = {e.pid for e in entries}
    root = s.target.root_pid

    def ids(tree: tuple[ProcInfo, ...], ns: dict[int, int]) -> dict[int, ProcInfo]:
        return {(ns[p.pid] if ns else p.pid): p for p in tree if not ns or p.pid in ns}

    if set(ids(s.target.tree, {int(k): v for k, v in s.resolved.pid_ns.items()})) == dumped:
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
    s.resolved.found = replace(s.target, tree=kept)
    pids = {p.pid for p in kept}
    s.resolved.pid_ns = {str(k): v for k, v in ns.items() if k in pids}


def _resume(s: DumpState, err: BaseException) -> None:
    """The host side of the rollback: the stopped tree runs again, CRIU's leftovers go."""
    if isinstance(err, StateUnknownError):
        return
    _announce_rollback(s)
    if s.saved.stopped_pids and s.saved.criu_options.tcp_established:
        # CRIU keeps a stopped tree's connections locked (repair mode, nftables): undo it first.
        for problem in tcpunlock.release(s.saved.stopped_pids, s.options.criu.network_lock):
            s.cb.note(f"rollback: {problem}")
    if s.saved.stopped_pids:  # not those stopped before the dump: CRIU kept them stopped
        proctree.signal_tree([p for p in s.saved.stopped_pids if p not in s.target.stopped], signal.SIGCONT)
    hostres.drop_remaps(s.saved.host_files)


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
    ours = _our_mount_ns(s.target.root_pid) or s.resolved.device_view
    remaps = hostres.link_remaps(layout.criu_dir(tmp)) if ours else []
    if remaps:
        s.cb.note(f"saving {len(remaps)} deleted file(s) the job has open (CRIU's link-remap files)")
    s.saved.host_files = saved + hostres.save_files(remaps, tmp, remap=True)
    if ours:
        s.saved.host_nodes = tuple(hostres.find_host_nodes(pids, paths))


def _check_plugin_marks(s: DumpState, tmp: Path) -> None:
    """A dump that went through a device plugin is good only without its error line in CRIU's
    log and with its device images (what Huawei's orchestrator checks): Huawei's for Ascend
    device files, npusim_plugin.so's (one image per daemon connection) for the simulated NPU."""
    log = layout.logs_dir(tmp) / layout.DUMP_LOG
    problems: list[str] = []
    if any(p.device_files for p in s.target.tree):
        problems += criuplugin.scan_dump(log if log.exists() else None, layout.criu_dir(tmp))
    sim = _simulated_npu_pids(s.target.tree)
    if sim:
        # A process holds a daemon connection once it opened a device.
        handles = sum(1 for pid in sim if _devices(s, pid))
        problems += criuplugin.scan_dump(
            log if log.exists() else None, layout.criu_dir(tmp), criuplugin.SIMULATED, handles
        )
    if problems:
        raise CriuError(
            f"CRIU's NPU plugin did not dump the device handles cleanly: {problems[0]}",
            why="; ".join(problems),
            fix=f"read {log} (the plugin's lines); check the plugin matches this CRIU (`npusnap check`)",
            details={"problems": problems, "criu_log": str(log)},
        )
