"""The image's manifest and checksums, and its publication: the dump publishes only an image that
passes the checks of `npusnap verify` and restore."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import __version__, acl, criu, replies
from npusnap_cli.errors import ImageError
from npusnap_cli.host import proctree
from npusnap_cli.image import devchunks, integrity, layout, publishing
from npusnap_cli.image.manifest import (
    ByteCounts,
    HostInfo,
    Manifest,
    ProcessEntry,
    Timings,
    Versions,
    now_iso,
)
from npusnap_cli.pipelines.dump.devmemory import _hash_device_files, agent_device_bytes
from npusnap_cli.pipelines.dump.state import DumpState


def _first(*values: Any) -> Optional[float]:
    return next((float(v) for v in values if v is not None), None)


def _sum(*values: Any) -> Optional[float]:
    known = [float(v) for v in values if v is not None]
    return sum(known) if known else None


def _versions(binary: criu.CriuBinary, hello: dict[int, replies.HelloReply]) -> Versions:
    cann: Optional[str] = None
    simulated = False
    for info in hello.values():
        a = info.acl
        if a.cann_version:
            cann = a.cann_version
        if a.library:
            version, simulated = acl.read_version_info(acl.home_of_library(a.library))
            cann = cann or version
            break
    home: Optional[str] = None
    for info in hello.values():
        library = info.acl.library
        if library:
            home = acl.home_of_library(library)
            break
    return Versions(
        tool=__version__,
        criu=binary.version,
        cann=cann,
        cann_simulated=simulated,
        python=sys.version.split()[0],
        cann_home=home,
    )


def _visible_devices(hello: Optional[replies.HelloReply]) -> Optional[str]:
    return hello.acl.visible_devices if hello is not None else None


def _devices(s: DumpState, pid: int) -> list[int]:
    """The devices a process has open: the runtime's own word first (npusnap's LOCK_PRE
    callback, once per open device), then what the agent saw (aclrtSetDevice followed)."""
    result = s.locked.lock_results.get(pid)
    from_callbacks = list(result.lock.callback_devices) if result is not None else []
    hello = s.agents.hello.get(pid)
    return from_callbacks or (list(hello.acl.devices) if hello is not None else [])


@contextlib.contextmanager
def _writing(s: DumpState) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise ImageError(
            f"writing the image failed: {exc.strerror or exc}",
            why="the disk is full or the filesystem refused a write"
            if getattr(exc, "errno", None) in (28, 122)
            else "the filesystem refused a write",
            fix=f"free space in {s.final.parent} (or choose another place) and dump again",
            details={"errno": exc.errno, "path": getattr(exc, "filename", None)},
        ) from None


def _checksums(s: DumpState) -> None:
    """The manifest, every file hashed (CRIU's and the device memory's): after the unlock, so
    that what is left to hash no longer keeps a --leave-running job frozen. Waits here for the
    hashers (and the disk they started)."""
    tmp = s.work
    manifest = _manifest(s)
    with _writing(s):
        assert s.saved.hasher is not None
        streamed = {f"{layout.CRIU_SUBDIR}/{rel}": v for rel, v in s.saved.hasher.finish().items()}
        if s.devmem.device_writeback is not None:
            s.devmem.device_writeback.stop()
            s.devmem.device_writeback = None
        if s.devmem.device_hasher is not None:
            hashed = s.devmem.device_hasher.finish().items()
            streamed.update({f"{layout.DEVICE_SUBDIR}/{rel}": v for rel, v in hashed})
        _hash_device_files(s, criu_done=True)  # chunked: started now if not alongside CRIU
        if s.devmem.chunk_writer is not None:
            chunks = s.devmem.chunk_writer.finish()
            streamed.update(chunks.files)
            device_total, device_new = chunks.device_total, chunks.device_new
        else:
            sizes = [v[0] for rel, v in streamed.items() if rel.startswith(layout.DEVICE_SUBDIR + "/")]
            device_total = device_new = sum(sizes)
        total = sum(layout.tree_size(tmp / d) for d in layout.CHECKSUMMED_SUBDIRS)
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            s.cb.progress("checksums", done[0], total)

        files = publishing.file_entries(tmp, advance, known=streamed)
    s.end.manifest = replace(
        manifest,
        files=files,
        bytes=replace(
            manifest.bytes,
            image_bytes=sum(f.size for f in files),
            device_total=device_total,
            device_new=device_new,
        ),
        timings=replace(manifest.timings, total_s=time.monotonic() - s.start),
    )


def _publish(s: DumpState) -> None:
    assert s.end.manifest is not None
    with _writing(s):
        if s.locked.lease is not None and s.saved.stopped_pids:
            s.locked.lease.check_before_kill(s.saved.stopped_pids)
        publishing.publish(
            s.work,
            s.final,
            s.end.manifest,
            force=s.options.force,
            sign_key=s.options.sign_key,
            check=lambda work: _verify_image(s, work),
        )
    s.area.tmp = None  # published: nothing partial left to remove


def _verify_image(s: DumpState, work: Path) -> None:
    """Before the image takes its name (and so before the original is killed): the checks
    `npusnap verify` and restore make of an image (trust, manifest, CRIU's process tree, the
    host files, every file present with its size). The checksums were computed from the bytes
    as they were written, so they are not read back. A failure is rolled back like any other:
    the job runs on and no image is left."""
    try:
        integrity.verify(work, checksums=False, unpublished=True)
        if not s.options.keep:
            # Only now: an image that failed keeps CRIU's log beside DIR for the report.
            layout.remove_tree(layout.logs_dir(work))
    except ImageError as err:
        err.message = f"the dump's image failed its own verification and was not kept: {err.message}"
        err.why = f"{err.why}; restore would refuse it, so the dump does not report success"
        err.fix = (
            "the job was rolled back and runs on; dump again, and report this (the message and "
            "the details of `--json`) if it repeats"
        )
        raise


def _manifest(s: DumpState) -> Manifest:
    npu = set(s.target.npu_pids)
    # Recorded with --leave-running too: the image holds the agents' memory from while the
    # dump held the lock, so the restored agents still know the dump as their owner.
    processes = []
    for p in s.target.tree:
        devices: list[int] = []
        nbytes = 0
        if p.pid in npu:
            devices = _devices(s, p.pid)
            nbytes = agent_device_bytes(s.agents.hello.get(p.pid))
        socket = p.agent_socket
        if p.pid in s.target.idle and not proctree.named_after(socket, p.pid):
            socket = None  # its parent's, held by a copy that ran no fork handler (yet)
        processes.append(
            ProcessEntry(
                pid=p.pid,
                ppid=p.ppid,
                cmdline=tuple(p.cmdline),
                uid=p.uid if p.uid is not None else -1,
                agent=socket is not None,
                npu=p.pid in npu,
                devices=tuple(sorted(set(devices))),
                device_bytes=nbytes,
                agent_socket=socket,
                lock_token=s.locked.lock_tokens.get(p.pid),
                visible_devices=_visible_devices(s.agents.hello.get(p.pid)),
                zombie=p.zombie,
            )
        )
    results = s.locked.lock_results
    # The runtime's Lock and Backup apart from npusnap's copy of the device memory, which runs
    # inside the agent's lock (or backup, in the legacy flow) and takes the seconds; an agent
    # that does not report them (an older one) has its whole lock and backup counted as such.
    lock_times = [r.lock.runtime_lock_s for r in results.values()]
    copy_times = [
        _sum(r.lock.device_copy_s, r.backup.device_copy_s if r.backup else None) for r in results.values()
    ]
    drain_times = [_sum(r.lock.drain_s, r.backup.drain_s if r.backup else None) for r in results.values()]
    backup_times = [max(0.0, float(r.last.elapsed_s) - float(r.last.device_copy_s)) for r in results.values()]
    stats = s.saved.criu_result.stats if s.saved.criu_result is not None else None
    us = 1e-6
    timings = Timings(
        preflight_s=s.timings.get("preflight", 0.0) + s.timings.get("attach", 0.0),
        lock_s=max((float(t) for t in lock_times if t is not None), default=None),
        backup_s=max((float(t) for t in backup_times if t is not None), default=None),
        device_copy_s=max((float(t) for t in copy_times if t is not None), default=None),
        drain_s=max((float(t) for t in drain_times if t is not None), default=None),
        criu_freeze_s=stats.freezing_time_us * us if stats else None,
        criu_memdump_s=stats.memdump_time_us * us if stats else None,
        criu_memwrite_s=stats.memwrite_time_us * us if stats else None,
        criu_total_s=s.saved.criu_s,
        unlock_s=s.timings.get("unlock") if s.options.leave_running else None,
        frozen_s=s.saved.frozen_end - s.locked.lock_start,
        attach_stopped_s=max((t for _, t in s.target.attach_stopped_s), default=None),
    )
    page = os.sysconf("SC_PAGE_SIZE")
    return Manifest(
        created_at=now_iso(),
        versions=_versions(s.binary, s.agents.hello),
        host=HostInfo.current(),
        root_pid=s.target.root_pid,
        processes=tuple(processes),
        timings=timings,
        bytes=ByteCounts(
            device_bytes=s.agents.device_bytes,
            image_bytes=0,
            criu_pages_bytes=(stats.pages_written * page) if stats else 0,
        ),
        criu_options=s.saved.criu_options.to_dict(),
        leave_running=s.options.leave_running,
        host_files=s.saved.host_files,
        host_nodes=s.saved.host_nodes,
        pid_ns=s.resolved.pid_ns,
        external_stdio=s.resolved.external,
        device_memory=_device_memory_record(s),
    )


def _device_memory_record(s: DumpState) -> dict[str, Any]:
    record = dict(s.agents.device_memory)
    processes = {k: dict(v) for k, v in (record.get("processes") or {}).items()}
    for pid, r in s.locked.lock_results.items():
        dm = r.device_memory
        entry = processes.setdefault(str(pid), {})
        entry["saved_bytes"] = dm.saved_bytes or 0
        # "driver": the runtime and driver kept it (args != NULL); "legacy": npusnap's copy
        entry["flow"] = dm.flow
        if dm.file_bytes:
            # the copy is this file (or this index of chunks), not process memory
            entry["file"] = devchunks.index_rel(pid) if s.devmem.chunked else layout.device_memory_rel(pid)
            save = dm.tracking.save if dm.tracking is not None else None
            if s.devmem.chunked and save is not None:
                # an incremental save of this process's later dump may start from this one
                entry["save"] = {"id": save.id, "epoch": save.epoch}
                if pid in s.devmem.incremental:
                    entry["base"] = s.devmem.incremental[pid].base.image.name
        stats = s.devmem.copy_stats.get(pid)
        if stats:
            # copied after the unlock while the job ran: pieces copied first for a write of the
            # job, and in the background
            entry["concurrent"] = {
                "cow_pieces": stats.cow_pieces,
                "background_pieces": stats.background_pieces,
            }
        if dm.fallback:
            entry["fallback"] = dm.fallback
    record["processes"] = processes
    return record
