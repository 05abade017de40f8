"""``RestoreState``: what the restore's steps share."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli import criu
from npusnap_cli.errors import NpusnapError
from npusnap_cli.host import hostres
from npusnap_cli.host.lazypages import LazyPhase, LazyReport
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.image import devchunks
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.engine import SignalGuard
from npusnap_cli.pipelines.restore.checks import Preflight
from npusnap_cli.pipelines.restore.options import RestoreOptions, RestoreOutcome, RestoreTimings
from npusnap_cli.pipelines.restore.verify import Checksums


@dataclass
class Checked:
    """The ``preflight`` step's (and the CRIU binary a job's ranks share)."""

    binary: Optional[criu.CriuBinary] = None
    pre: Optional[Preflight] = None
    # pstree.img id -> the signal that stopped it, of the processes CRIU restores stopped
    stopped_in_image: Optional[dict[int, int]] = None


@dataclass
class Verifying:
    """The ``verify`` step's: the checksums, computed while the later steps run."""

    checksums: Optional[Checksums] = None
    device_checks: Optional[Checksums] = None  # the device-memory files, on into the device step
    assembly: Optional[devchunks.Assembly] = None  # chunked device memory put together, ditto
    verified_at: float = 0.0


@dataclass
class HostSide:
    """What the steps before CRIU opened and made on the host for the job."""

    device_memory_files: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (fd, name)
    inherit: list[tuple[str, int]] = field(default_factory=list)  # CRIU key -> fd (--pipe-to, --output)
    made: list[str] = field(default_factory=list)  # host directories and fifos created for the job
    created: list[hostres.HostFile] = field(default_factory=list)  # files put back that were absent
    view: Optional[Path] = None  # a --pid-ns image's CRIU directory as this copy restores it


@dataclass
class TreeBack:
    """The ``criu restore`` and ``release`` steps': the tree CRIU made, and its guards."""

    lazy: Optional[LazyPhase] = None
    stop_guard: Optional[StopGuard] = None
    result: Optional[criu.RestoreResult] = None
    criu_done: float = 0.0
    released: float = 0.0
    lazy_report: Optional[LazyReport] = None


@dataclass
class DeviceBack:
    """The ``pidfile`` and ``device restore`` steps'."""

    device_done: float = 0.0
    pidfile: Optional[str] = None
    pidfile_error: Optional[NpusnapError] = None


@dataclass
class RestoreState:
    """What the restore's steps share: the inputs, then one group per step that fills it in; the
    job restore (jobsnap/) extends it per rank."""

    image: Path  # the image directory (a pointer followed)
    manifest: Manifest  # after CRIU, of a --pid-ns image: with the restored copy's host pids
    options: RestoreOptions
    cb: PipelineCallbacks
    guard: SignalGuard
    start: float = field(default_factory=time.monotonic)
    # True: the checksums are computed while the checks and CRIU run, and CRIU leaves the tree
    # stopped until they matched. False (a job's ranks): every checksum is known first.
    overlap: bool = True
    checks: Checked = field(default_factory=Checked)
    verifying: Verifying = field(default_factory=Verifying)
    host: HostSide = field(default_factory=HostSide)
    tree: TreeBack = field(default_factory=TreeBack)
    device: DeviceBack = field(default_factory=DeviceBack)

    @property
    def checked(self) -> Preflight:
        if self.checks.pre is None:
            raise RuntimeError("the restore's preflight step did not run")
        return self.checks.pre

    @property
    def restored(self) -> criu.RestoreResult:
        if self.tree.result is None:
            raise RuntimeError("CRIU's restore step did not run")
        return self.tree.result

    @property
    def npu_pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.manifest.npu_processes)

    def close(self) -> None:
        """Whatever the outcome: stop hashing, close the files the steps opened."""
        for c in (self.verifying.checksums, self.verifying.device_checks, self.verifying.assembly):
            if c is not None:
                c.cancel()
                c.join()
        _close_inherited(self)
        for fd, _path in self.host.device_memory_files.values():
            os.close(fd)
        self.host.device_memory_files = {}

    def outcome(self) -> RestoreOutcome:
        res = self.restored
        stats = res.stats
        verify_s = self.verifying.verified_at - self.start
        return RestoreOutcome(
            image=str(self.image),
            root_pid=res.pid,
            pids=tuple(p.pid for p in self.manifest.processes),
            npu_pids=self.npu_pids,
            timings=RestoreTimings(
                verify_wait_s=self.tree.released - self.tree.criu_done,
                verify_s=verify_s,
                criu_restore_s=self.tree.criu_done - self.start - verify_s,
                criu_forking_s=stats.forking_time_us * 1e-6 if stats else None,
                criu_restore_only_s=stats.restore_time_us * 1e-6 if stats else None,
                device_restore_s=self.device.device_done - self.tree.released,
                total_s=self.device.device_done - self.start,
                lazy_complete_s=self.tree.lazy_report.complete_s if self.tree.lazy_report else None,
            ),
            criu_log=res.log_path,
            pidfile=self.device.pidfile,
            device_memory=self.checked.device_memory,
            lazy=self.tree.lazy_report,
        )


def _close_inherited(st: RestoreState) -> None:
    for fd in {fd for _key, fd in st.host.inherit}:
        os.close(fd)
    st.host.inherit = []
