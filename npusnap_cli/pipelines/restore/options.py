"""What `npusnap restore` is asked to do (``RestoreOptions``) and what it answers
(``RestoreOutcome``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli.host.lazypages import LazyReport
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.pipelines.callbacks import PipelineCallbacks

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
RestoreCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class RestoreOptions:
    verify: bool = True  # the checksum of every file (structure and sizes are always checked)
    pidfile: Optional[Path] = None
    lease_s: Optional[float] = None
    logs: Optional[Path] = None  # where CRIU's restore log goes (default: DIR/logs, else elsewhere)
    pipe_to: Optional[Path] = None  # new output for pipes recorded with dump --external-pipes
    replace_tmpfs_files: bool = False  # overwrite changed tmpfs files instead of refusing
    settle_s: float = 0.5  # watch the resumed tree this long; a death fails the restore
    require_signature: Optional[Path] = None  # Ed25519 public key (PEM) the image must be signed with
    accept_lost_device_memory: bool = False  # restore a --device-memory discard image anyway
    # Host memory paged in by `criu lazy-pages` while the job already runs (docs/reference/restore.md):
    # the page files are verified while it runs, and the restore returns once every page is in.
    lazy: bool = False
    lazy_timeout_s: float = 600.0  # the whole page-in (and the page files' checksums) must end by then
    # (image device, device) pairs: restore onto other devices (a --pid-ns image, simulated NPU)
    device_map: tuple[tuple[int, int], ...] = ()
    output: Optional[Path] = None  # the job writes here instead of its stdout file (a copy's own)
    tcp_close: bool = False  # established TCP connections restored closed (a copy beside the original)
    criu_passthrough: tuple[str, ...] = ()  # CRIU options passed through (criupass.parse)


@dataclass(frozen=True)
class RestoreTimings:
    verify_wait_s: float  # waiting for the checksums after CRIU (they overlap with it)
    verify_s: float
    criu_restore_s: float
    criu_forking_s: Optional[float]
    criu_restore_only_s: Optional[float]
    device_restore_s: float
    total_s: float
    # --lazy only: from the start until the last page was in and the page files were verified
    lazy_complete_s: Optional[float] = None

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
    lazy: Optional[LazyReport] = None  # --lazy: how the page-in went

    def to_dict(self) -> JSONObject:
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
            "lazy": None if self.lazy is None else self.lazy.to_json(),
        }
