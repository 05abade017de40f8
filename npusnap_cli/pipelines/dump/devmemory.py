"""The device memory of a dump: what keeps it across the snapshot (``check_device_memory``), the
image's files the agents copy it into, their checksums or chunks, and the copy a --leave-running
dump makes after the unlock while the job runs."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any, Optional

from npusnap_cli import contract, replies
from npusnap_cli.device.devicegroup import LockedAndBackedUp
from npusnap_cli.errors import DeviceError, ImageError, PreflightError, TargetError
from npusnap_cli.host import devmaps
from npusnap_cli.image import devchunks, digest, layout, streamhash
from npusnap_cli.image.streamhash import FileHasher, WritebackFollower
from npusnap_cli.pipelines.dump.state import DumpState, _sampling
from npusnap_cli.pipelines.dump.target import _rss

# Cores from which the device-memory files are hashed alongside CRIU's dump: one for CRIU, one for
# the hash, the rest for the disk's writeback and the kernel. With fewer they are hashed once CRIU
# is done, on every core: with fewer cores, hashing alongside slows CRIU and keeps the job frozen
# longer for no shorter dump (docs/benchmarks.md, "Measurements behind design choices").
HASH_ALONGSIDE_CRIU_CORES = 4


def _device_memory_in_process() -> bool:
    """``NPUSNAP_DEVMEM_IN_PROCESS=1``: the agents keep their copy of the device memory in the
    process's memory for CRIU to save (how it was done before the image's device files; the
    benchmarks compare the two)."""
    return os.environ.get("NPUSNAP_DEVMEM_IN_PROCESS") == "1"


def _device_memory_file_size(dm: replies.DeviceMemory) -> int:
    """What an agent's device-memory file will hold at most, from its hello: a 32-byte header,
    24 bytes per allocation, then the bytes of those not excluded (native/agent/devmem.c)."""
    count = dm.allocations or 0
    data = (dm.bytes or 0) - (dm.excluded_bytes or 0)
    return 32 + 24 * count + max(0, data)


def _empty_files(files: dict[int, tuple[int, str]]) -> None:
    """Before another lock attempt: the device-memory files from the start again."""
    for fd, _name in files.values():
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)


def agent_device_bytes(hello: Optional[replies.HelloReply]) -> int:
    """The device memory an agent will copy (its records, less what the application excluded)."""
    if hello is None:
        return 0
    dm = hello.device_memory
    return max(0, (dm.bytes or 0) - (dm.excluded_bytes or 0))


# --------------------------------------------------------------------------------------------
# Device memory: is continuity guaranteed?
# --------------------------------------------------------------------------------------------

DEVICE_MEMORY_MODES = contract.DEVICE_MEMORY_MODES
CONTINUITY = {"preserve": "npusnap", "app": "application", "discard": "lost"}


def check_device_memory(
    mode: str,
    hello: dict[int, replies.HelloReply],
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
        dm = h.device_memory
        mapped = (maps or {}).get(pid)
        has_memory = bool(dm.bytes or h.acl.devices or h.acl.callback_devices or (mapped and mapped.present))
        tracked = bool(dm.interposed) or (dm.registered or 0) > 0
        processes[str(pid)] = {
            "interposed": bool(dm.interposed),
            "registered": dm.registered or 0,
            "allocations": dm.allocations or 0,
            "bytes": dm.bytes or 0,
            "vmm_bytes": dm.vmm_bytes or 0,
            "excluded_bytes": dm.excluded_bytes or 0,
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


# -- the image's device-memory files, written while the job is locked ---------------------------


def _written_bytes(st: os.stat_result) -> int:
    """What a file holds so far: a file sized up front (ftruncate) has only its written blocks."""
    return min(st.st_size, st.st_blocks * 512)


@contextlib.contextmanager
def _backup_progress(s: DumpState) -> Iterator[None]:
    """Bytes backed up, as the growth of the NPU processes' host memory (Backup copies into it)."""
    if not s.agents.device_bytes:
        yield
        return
    pids = s.target.npu_pids
    before = sum(_rss(p) for p in pids)
    total = s.agents.device_bytes

    def report(n: int) -> None:
        s.cb.progress("device memory copy", min(total, max(0, n)), total)

    def written() -> int:
        # The agents copy into the image's device-memory files when they have them (their host
        # memory does not grow then): those files' sizes are the progress.
        d = s.area.tmp / layout.DEVICE_SUBDIR if s.area.tmp is not None else None
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
    if s.devmem.chunked:
        s.devmem.sharing = devchunks.Sharing(s.published, s.options.parent)
        if s.options.leave_running and os.environ.get("NPUSNAP_NO_CONCURRENT") != "1":
            s.devmem.concurrent = 2 if os.environ.get("NPUSNAP_TEST_CHECK_CONCURRENT") == "1" else 1
        if os.environ.get("NPUSNAP_NO_INCREMENTAL") != "1":
            s.devmem.bases = _bases(s.devmem.sharing, s.agents.hello)
    try:
        for pid, h in sorted(s.agents.hello.items()):
            dm = h.device_memory
            if not dm.available or not dm.allocations:
                continue
            rel = layout.device_memory_rel(pid)
            path = tmp / rel
            path.parent.mkdir(mode=layout.DIR_MODE, exist_ok=True)
            if s.devmem.chunked:
                # A memory file: only the pieces no earlier image holds reach the disk.
                fd = os.memfd_create(f"npusnap-devmem-{pid}", os.MFD_CLOEXEC)
                s.devmem.device_streams[pid] = os.dup(fd)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, layout.FILE_MODE)
            # The agent records where the file will be once published, for a reload without
            # a descriptor (a lease's rollback after an interrupted restore): never a work
            # directory, which is gone by then.
            files[pid] = (
                fd,
                os.path.abspath(s.published / (devchunks.index_rel(pid) if s.devmem.chunked else rel)),
            )
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
    if files and not s.devmem.chunked:
        # The agents write them with several threads, a chunk at a time at its place: the disk
        # starts on them meanwhile, and they are hashed once the lock answered
        # (_hash_device_files).
        s.devmem.device_writeback = WritebackFollower(tmp / layout.DEVICE_SUBDIR).start()
    return files


def _bases(sharing: devchunks.Sharing, hello: dict[int, replies.HelloReply]) -> dict[int, devchunks.BaseSave]:
    """pid -> the newest earlier image holding a save its agent still knows (the base of an
    incremental save: only what the job wrote since is copied)."""
    bases = {}
    for pid, h in sorted(hello.items()):
        tracking = h.device_memory.tracking
        if tracking is None:
            continue
        lineage = list(tracking.lineage)
        if lineage and not tracking.untracked:
            base = devchunks.find_base(sharing, lineage)
            if base is not None:
                bases[pid] = base
    return bases


def _incremental(s: DumpState, results: dict[int, LockedAndBackedUp]) -> None:
    """What each agent left out of its save (since its base), for the chunk writer."""
    check = os.environ.get("NPUSNAP_TEST_CHECK_WRITES") == "1"
    for pid, base in s.devmem.bases.items():
        result = results.get(pid)
        tracking = result.device_memory.tracking if result is not None else None
        save = tracking.save if tracking is not None else None
        if save is not None and save.since_used:
            s.devmem.incremental[pid] = devchunks.Incremental(base, bytes.fromhex(save.unchanged), check)


def _close_streams(s: DumpState) -> None:
    for fd in s.devmem.device_streams.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    s.devmem.device_streams = {}


def _hash_device_files(s: DumpState, *, criu_done: bool) -> None:
    """Hash the device-memory files the agents wrote (the lock answered): alongside CRIU's dump
    of the host side, on one core, where cores are to spare (HASH_ALONGSIDE_CRIU_CORES); on
    every core once CRIU is done and the job stays stopped. Chunked: cut the memory files into
    chunks (on every core once CRIU is done)."""
    if s.devmem.chunked:
        if s.devmem.concurrent and not s.devmem.copy_done:
            return  # the agents copy after the unlock
        if (
            s.devmem.chunk_writer is None
            and s.devmem.device_streams
            and (criu_done or digest.usable_cores() >= HASH_ALONGSIDE_CRIU_CORES)
        ):
            sharing = s.devmem.sharing or devchunks.Sharing(s.published, s.options.parent)
            streams, s.devmem.device_streams = s.devmem.device_streams, {}
            s.devmem.chunk_writer = devchunks.ChunkWriter(
                s.work, sharing, streams, threads=digest.usable_cores(), incremental=s.devmem.incremental
            ).start()
        return
    if not criu_done and s.devmem.device_writeback is not None:
        s.devmem.device_writeback.finish()  # stopped for good (joined) at publish or rollback
    if s.devmem.device_hasher is None:
        if not criu_done and digest.usable_cores() < HASH_ALONGSIDE_CRIU_CORES:
            return
        if not (s.work / layout.DEVICE_SUBDIR).is_dir():
            return
        s.devmem.device_hasher = FileHasher(s.work / layout.DEVICE_SUBDIR)
        if criu_done and not s.options.leave_running:
            s.devmem.device_hasher.boost()
        s.devmem.device_hasher.start()
    elif criu_done and not s.options.leave_running:
        s.devmem.device_hasher.boost()  # the job stays stopped from here on: its cores are free


def _drop_unused_device_memory_files(s: DumpState, results: dict[int, LockedAndBackedUp]) -> None:
    """Remove the files an agent did not use (the driver-backed flow kept the memory)."""
    for pid in sorted(results):
        path = s.work / layout.device_memory_rel(pid)
        if results[pid].device_memory.file_bytes:
            continue
        if path.exists():
            path.unlink()
        fd = s.devmem.device_streams.pop(pid, None)
        if fd is not None:
            os.close(fd)


# -- the copy after the unlock (--leave-running) ------------------------------------------------


# The concurrent copy runs at the device's copy speed, the job's writes helping; beyond this the
# dump gives up (the job runs on, no image is kept).
COPY_DEADLINE_S = 1800.0
POISON = 0xA5


def _unlock_and_copy(s: DumpState) -> None:
    """Unlock, the agents copying the device memory into the memory files while the job runs
    (a piece it is about to write first); wait for them. Checked (``concurrent == 2``): the copy
    goes to a memory file of its own, poisoned, and is compared with the cut's copy."""
    targets = {pid: fd for pid, fd in s.devmem.device_streams.items() if pid in s.locked.lock_results}
    reference: dict[int, int] = {}
    if s.devmem.concurrent == 2:
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
        s.saved.frozen_end = time.monotonic()
        s.cb.phase("device copy")
        s.devmem.copy_stats = s.group.copy_wait(set(names), COPY_DEADLINE_S)
        left = {pid: r.left for pid, r in s.devmem.copy_stats.items() if not r.complete}
        if left:
            raise DeviceError(
                f"the concurrent copy of the device memory did not end within {COPY_DEADLINE_S:.0f} s",
                why=f"pieces left per pid: {left}",
                fix="the job runs on; dump again (NPUSNAP_NO_CONCURRENT=1 copies while the job is held)",
            )
        for pid, ref in reference.items():
            _compare_concurrent(pid, ref, targets[pid], s.devmem.copy_stats.get(pid))
        s.devmem.copy_done = True
    finally:
        for pid in reference:
            os.close(targets[pid])


def _meta_size(fd: int) -> int:
    head = os.pread(fd, contract.DEVMEM_FILE_HEADER.size, 0)
    _magic, count, _total = contract.DEVMEM_FILE_HEADER.unpack_from(head, 0)
    return int(contract.DEVMEM_FILE_HEADER.size + count * contract.DEVMEM_FILE_RECORD.size)


def _compare_concurrent(
    pid: int, reference: int, copied: int, stats: Optional[replies.CopyWaitReply]
) -> None:
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
    said = stats.cow_pieces + stats.background_pieces if stats is not None else 0
    if copied_pieces != said:
        raise DeviceError(
            f"the concurrent copy of pid {pid} wrote {copied_pieces} pieces and says {said}",
            fix="report this; dump with NPUSNAP_NO_CONCURRENT=1 meanwhile",
        )
