"""What `npusnap dump` is asked to do (``DumpOptions``) and what it answers (``DumpOutcome``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import contract
from npusnap_cli.criu import CriuOptions
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.pipelines.callbacks import PipelineCallbacks

DEFAULT_LEASE_S = 60.0

# The pipeline's progress reporting (see callbacks.py); the name is kept for callers.
DumpCallbacks = PipelineCallbacks


@dataclass(frozen=True)
class DumpOptions:
    """What `npusnap dump` was asked to do: CRIU's options as given (CRIU/podman names and
    meanings), and npusnap's own."""

    criu: CriuOptions = field(default_factory=CriuOptions)
    keep: bool = False
    force: bool = False
    attach: bool = True
    lease_s: float = DEFAULT_LEASE_S
    # Pipes to outside the tree on stdin/out/err recorded for `restore --pipe-to` (host/hostres/).
    external_pipes: bool = False
    sign_key: Optional[Path] = None  # Ed25519 private key (PEM): sign the manifest (imagetrust)
    device_memory: str = contract.DEFAULT_DEVICE_MEMORY_MODE  # docs/device-memory.md
    # How long each agent waits for its devices to drain after Lock; None: 10 s, or
    # DRAIN_TIMEOUT_GROUP_S for a tree of several NPU processes.
    drain_timeout_s: Optional[float] = None
    # Lock attempts after a device that did not drain; None: 1, or BUSY_RETRIES_GROUP for a tree of
    # several NPU processes (a job dump sets 0 and retries all its ranks together).
    busy_retries: Optional[int] = None
    # An earlier image of the job whose device-memory chunks this one may share, besides the
    # images next to it (devchunks.py).
    parent: Optional[Path] = None

    @property
    def leave_running(self) -> bool:
        return self.criu.leave_running

    def criu_for(self, tree: tuple[ProcInfo, ...], tcp_within: bool = False) -> CriuOptions:
        """What CRIU is asked for ``tree``: unless it runs on, the tree stays stopped after the
        dump (it is killed once the image is published), no network lock where it would lock
        nothing (a --network-lock given always wins), and --tcp-established when every TCP
        connection of the tree has both ends in it (``tcp_within``)."""
        o = self.criu
        tcp = o.tcp_established or tcp_within
        return replace(
            o,
            leave_stopped=not o.leave_running,
            tcp_established=tcp,
            network_lock=o.network_lock or _unneeded_network_lock(tree, tcp),
        )


@dataclass(frozen=True)
class DumpOutcome:
    image: str
    manifest: Manifest
    attached: tuple[int, ...] = ()
    logs: Optional[str] = None
    # pid -> how long the dump's attach stopped it (upper bound; the manifest keeps the longest)
    attach_stopped_s: tuple[tuple[int, float], ...] = ()
    # What the stale-temp cleanup did next to DIR (removed, recovered, refused: one line each).
    leftovers: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        timings: dict[str, Any] = dict(m.timings.to_dict())
        return {
            "image": self.image,
            "leftovers": list(self.leftovers),
            "created_at": m.created_at,
            "root_pid": m.root_pid,
            "npu_pids": [p.pid for p in m.npu_processes],
            "pids": [p.pid for p in m.processes],
            "leave_running": m.leave_running,
            "attached": list(self.attached),
            # A job stalls while attach stops it too, not only while it is frozen for the dump.
            "attach_stopped": {str(p): s for p, s in self.attach_stopped_s},
            "logs": self.logs,
            "timings": timings,
            "bytes": m.bytes.to_dict(),
            "versions": m.versions.to_dict(),
            "processes": [p.to_dict() for p in m.processes],
            "device_memory": dict(m.device_memory),
        }


def _unneeded_network_lock(tree: tuple[ProcInfo, ...], tcp_established: bool) -> Optional[str]:
    """``"skip"`` where CRIU's network lock would lock nothing, so that the dump does not pay for
    it: a tree wholly in this host's network namespace is locked one TCP connection at a time,
    which only --tcp-established dumps have, yet CRIU's nftables method still creates its table up
    front, a large part of a small dump's CRIU time. None (CRIU's default method) for a
    tree in a network namespace of its own (CRIU locks the whole namespace) or with
    --tcp-established; a --network-lock on the command line always wins."""
    if tcp_established:
        return None
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        # A zombie has no namespaces left (its /proc/PID/ns/net is gone).
        if all(os.stat(f"/proc/{p.pid}/ns/net").st_ino == mine for p in tree if not p.zombie):
            return "skip"
    except OSError:
        pass
    return None
