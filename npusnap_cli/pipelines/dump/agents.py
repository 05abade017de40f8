"""The steps that talk to the agents: connect, hello, lock + backup (with its rollback), unlock."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from npusnap_cli import criu
from npusnap_cli.device.devicegroup import DeviceGroup, forget_taken_over
from npusnap_cli.errors import NpusnapError, StateUnknownError
from npusnap_cli.host import devmaps, procfs
from npusnap_cli.pipelines.dump.devmemory import (
    _backup_progress,
    _device_memory_in_process,
    _drop_unused_device_memory_files,
    _empty_files,
    _hash_device_files,
    _incremental,
    _open_device_memory_files,
    _unlock_and_copy,
    agent_device_bytes,
    check_device_memory,
)
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.target import _mem_available
from npusnap_cli.pipelines.dump.treechecks import _check_space_and_memory
from npusnap_cli.pipelines.engine import describe
from npusnap_cli.units import human_bytes

# After Lock every agent drains its devices (a bounded synchronize) before it copies: a device
# still busy at the deadline fails the attempt, everything is rolled back and it is tried again.
DRAIN_TIMEOUT_GROUP_S = 3.0
BUSY_RETRIES_GROUP = 5
BUSY_RETRIES = 1


# Host memory left over while the chunked device memory is staged in memory files.
CHUNK_STAGING_RESERVE = 512 << 20


def _gone_children(s: DumpState) -> list[int]:
    """Children that held only their parent's agent socket when the tree was resolved (forked a
    moment before, no device of their own opened: such a child has no agent to ask) and have
    exited since (a job that forks and ends a child at every step). The resolution could not
    tell them from NPU processes because they vanished while it looked; gone before the
    freeze, they are not part of the snapshot (CRIU freezes what is there, the manifest lists
    what it froze). A process with an agent of its own is never among them: a rank that dies
    mid-dump fails it."""
    t = s.target
    borrowed = set(t.borrowed_socket) & set(t.npu_pids) - {t.root_pid}
    return sorted(p for p in borrowed if procfs.state(p) in (None, "Z", "X"))


def _connect(s: DumpState) -> None:
    gone = _gone_children(s)
    if gone and len(gone) < len(s.target.npu_pids):
        s.resolved.found = dataclasses.replace(
            s.target, npu_pids=tuple(p for p in s.target.npu_pids if p not in gone)
        )
        s.cb.note(f"pid(s) {', '.join(map(str, gone))} exited before the freeze: not in the snapshot")
    s.agents.devices = DeviceGroup(
        s.target.npu_pids,
        lease_s=s.options.lease_s,
        command="dump",
        interrupted=lambda: s.guard.received is not None,
    )


def _disconnect(s: DumpState, _err: BaseException) -> None:
    # An agent serves one client: a job dump may try again at once.
    s.group.close()


def _hello(s: DumpState) -> None:
    s.agents.hello = s.group.hello()
    # Another command's lock (a freeze, an external checkpoint, a dump in progress): refuse
    # here, having changed nothing, rather than fail at Lock.
    s.group.ensure_unlocked()
    maps = {pid: devmaps.device_memory(pid) for pid in s.target.npu_pids}
    mode = s.options.device_memory
    s.agents.device_memory = check_device_memory(mode, s.agents.hello, maps)
    if mode == "preserve":
        s.agents.device_bytes = sum(agent_device_bytes(h) for h in s.agents.hello.values())
    # Host memory for the device memory only where a copy of it is held there (the agent
    # writes it into the image in small pieces by default).
    in_process = mode == "preserve" and _device_memory_in_process()
    _check_space_and_memory(
        s.final, s.resolved.host_bytes + s.agents.device_bytes, s.agents.device_bytes if in_process else 0
    )
    # NPUSNAP_DEVMEM_FLAT=1: one file per process, as images before chunks (benchmarks compare).
    flat = os.environ.get("NPUSNAP_DEVMEM_FLAT") == "1"
    s.devmem.chunked = mode == "preserve" and not in_process and not flat and bool(s.agents.device_bytes)
    avail = _mem_available()
    if s.devmem.chunked and avail is not None and avail - s.agents.device_bytes < CHUNK_STAGING_RESERVE:
        s.devmem.chunked = False
        s.cb.note(
            f"device memory written as one full file per process, not as chunks shared with "
            f"earlier images: {human_bytes(s.agents.device_bytes)} of device memory would not fit in "
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
    s.locked.locking = True
    # A note a `thaw --force` left for a dead command of this pid is not about this dump's lock.
    forget_taken_over(s.target.npu_pids, os.getpid())
    # The files first, while the job still runs: reserving their room takes time with the size.
    files = _open_device_memory_files(s)
    s.locked.lock_start = time.monotonic()
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
                since={pid: b.save_id for pid, b in s.devmem.bases.items()},
                check_writes=os.environ.get("NPUSNAP_TEST_CHECK_WRITES") == "1",
                concurrent=s.devmem.concurrent,
            )
    finally:
        for fd, _name in files.values():
            os.close(fd)
    s.locked.lock_tokens = s.group.tokens()
    s.locked.lock_results = results
    _incremental(s, results)
    _drop_unused_device_memory_files(s, results)
    _hash_device_files(s, criu_done=False)


def _announce_rollback(s: DumpState) -> None:
    if not s.end.rolling_back:
        s.end.rolling_back = True
        s.cb.phase("rollback")


def _roll_back_devices(s: DumpState, err: BaseException) -> None:
    """Every locked process back to RUNNING; StateUnknownError (carrying ``err``) if not."""
    if isinstance(err, StateUnknownError):
        return  # nothing is known well enough to act on: the error says how to recover
    _announce_rollback(s)
    if s.locked.lease is not None and s.locked.lease.gave_up(err):
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
        if s.area.tmp is not None:
            unknown.details["partial_image_removed"] = str(s.area.tmp)
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


def _describe(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return describe(err)


# -- unlock (--leave-running) -------------------------------------------------------------------


def _unlock(s: DumpState) -> None:
    s.group.reconnect()
    try:
        if s.devmem.concurrent:
            _unlock_and_copy(s)
        else:
            s.group.unlock()
            s.saved.frozen_end = time.monotonic()
    finally:
        s.group.close()
