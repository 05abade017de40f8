"""``DumpState``, what the dump's steps share, and the progress sampling of its long steps."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criu, replies
from npusnap_cli.criu import CriuOptions
from npusnap_cli.device.devicegroup import DeviceGroup, LockedAndBackedUp
from npusnap_cli.device.leasekeeper import LeaseKeeper
from npusnap_cli.host import hostres
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.image import devchunks
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.image.streamhash import FileHasher, StreamHasher, WritebackFollower
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump.options import DumpOptions, DumpOutcome
from npusnap_cli.pipelines.dump.target import _Target
from npusnap_cli.pipelines.engine import SignalGuard

_POLL_S = 0.2


# --------------------------------------------------------------------------------------------
# Progress sampling in a background thread
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sampling(sample: Callable[[], int], report: Callable[[int], None]) -> Iterator[None]:
    """Call ``report(sample())`` every few hundred ms while the body runs (and once at the end)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(_POLL_S):
            with contextlib.suppress(Exception):
                report(sample())

    t = threading.Thread(target=loop, name="npusnap-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        with contextlib.suppress(Exception):
            report(sample())


@dataclass
class Resolved:
    """What the ``resolve`` and ``preflight`` steps found (and their checks: checks.py)."""

    found: Optional[_Target] = None
    criu_binary: Optional[criu.CriuBinary] = None
    external: tuple[hostres.ExternalStdio, ...] = ()  # recorded for restore
    tcp_within: bool = False  # every TCP connection of the tree has both ends in it
    pid_ns: dict[str, int] = field(default_factory=dict)  # host pid -> pid in the job's namespace
    device_view: bool = False  # the tree runs in a container of the simulated NPU (pidns.py)
    host_bytes: int = 0


@dataclass
class WorkArea:
    """The ``work area`` step's: the image's work directory until it is published."""

    tmp: Optional[Path] = None
    started: bool = False  # the work directory exists: failures from here on are enriched
    leftovers: tuple[str, ...] = ()  # what the stale-temp cleanup next to DIR did


@dataclass
class Agents:
    """The ``connect`` and ``hello`` steps': the agents and what they said."""

    devices: Optional[DeviceGroup] = None
    hello: dict[int, replies.HelloReply] = field(default_factory=dict)
    device_memory: dict[str, Any] = field(default_factory=dict)  # the manifest's record
    device_bytes: int = 0  # from the agents' records


@dataclass
class Locked:
    """The ``lock+backup`` step's: what holds the job from the lock on."""

    locking: bool = False  # Lock was attempted: a failure from here on was rolled back
    lock_start: float = 0.0
    lock_results: dict[int, LockedAndBackedUp] = field(default_factory=dict)
    lock_tokens: dict[int, str] = field(default_factory=dict)
    lease: Optional[LeaseKeeper] = None  # from the lock to the kill
    stop_guard: Optional[StopGuard] = None  # resumes the tree if npusnap dies


@dataclass
class DeviceCopy:
    """The device memory's copy (devmemory.py), from the lock until the image is published."""

    device_hasher: Optional[FileHasher] = None  # the device-memory files
    device_writeback: Optional[WritebackFollower] = None  # while the agents write them
    # The device memory kept as chunks (devchunks.py): the agents write into memory files
    # (pid -> fd), which the writer cuts into chunks, linking those earlier images hold.
    chunked: bool = False
    device_streams: dict[int, int] = field(default_factory=dict)
    chunk_writer: Optional[devchunks.ChunkWriter] = None
    sharing: Optional[devchunks.Sharing] = None  # the earlier images chunks are linked from
    bases: dict[int, devchunks.BaseSave] = field(default_factory=dict)  # pid -> its incremental base
    incremental: dict[int, devchunks.Incremental] = field(default_factory=dict)  # what the agents left out
    # --leave-running: the job's device memory is copied after the unlock, while it runs (1; 2:
    # and at the cut as well, compared after: NPUSNAP_TEST_CHECK_CONCURRENT=1).
    concurrent: int = 0
    copy_done: bool = False
    copy_stats: dict[int, replies.CopyWaitReply] = field(default_factory=dict)


@dataclass
class Saved:
    """The ``criu`` step's: CRIU's dump and what was saved of the host while frozen."""

    criu_options: CriuOptions = field(default_factory=CriuOptions)
    criu_result: Optional[criu.DumpResult] = None
    criu_s: float = 0.0  # CRIU's own run
    criu_done: float = 0.0
    frozen_end: float = 0.0
    stopped_pids: list[int] = field(default_factory=list)  # left stopped by CRIU until the kill
    host_files: tuple[hostres.HostFile, ...] = ()  # saved while frozen
    host_nodes: tuple[hostres.HostNode, ...] = ()  # dirs and FIFOs restore needs
    hasher: Optional[StreamHasher] = None  # follows CRIU's writes


@dataclass
class Ending:
    """The ``publish`` and ``finish`` steps', or the rollback's."""

    manifest: Optional[Manifest] = None
    rolling_back: bool = False
    failure_logs: Optional[str] = None  # where the discarded image's logs were kept
    outcome: Optional[DumpOutcome] = None


@dataclass
class DumpState:
    """What the dump's steps share: the inputs, then one group per step that fills it in as it
    goes (the steps are in steps.py, in order)."""

    pid: int
    final: Path
    options: DumpOptions
    cb: PipelineCallbacks
    guard: SignalGuard
    check: Optional[criu.CriuCheck]  # `criu check`, started when the dump began (None: no CRIU)
    in_job: bool  # one rank of a coordinated job dump
    # Where the image will stay once published: ``final``, or for a rank of a job dump its place
    # in the job image (``final`` is inside the job's work directory, which is renamed).
    published: Path
    start: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)  # the engine's, per step
    resolved: Resolved = field(default_factory=Resolved)
    area: WorkArea = field(default_factory=WorkArea)
    agents: Agents = field(default_factory=Agents)
    locked: Locked = field(default_factory=Locked)
    devmem: DeviceCopy = field(default_factory=DeviceCopy)
    saved: Saved = field(default_factory=Saved)
    end: Ending = field(default_factory=Ending)

    @property
    def target(self) -> _Target:
        assert self.resolved.found is not None
        return self.resolved.found

    @property
    def binary(self) -> criu.CriuBinary:
        assert self.resolved.criu_binary is not None
        return self.resolved.criu_binary

    @property
    def group(self) -> DeviceGroup:
        assert self.agents.devices is not None
        return self.agents.devices

    @property
    def work(self) -> Path:
        assert self.area.tmp is not None
        return self.area.tmp
