"""What CRIU is asked for (``CriuOptions``, named as in `criu dump`), and their translation into
pycriu's options message."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any, Optional, TypedDict

# CRIU's log levels: 0 none .. 4 debug. Debug costs little next to the memory dump and is what a
# CRIU developer asks for first, so it is the default.
DEFAULT_LOG_LEVEL = 4


class CriuOptionsRecord(TypedDict, total=False):
    """``CriuOptions.to_dict()``: the image manifest's ``criu_options``, as written and read (an
    older image lacks the keys added since: every key may be absent)."""

    leave_running: bool
    leave_stopped: bool
    tcp_established: bool
    shell_job: bool
    file_locks: bool
    ext_unix_sk: bool
    external: list[str]
    timeout: Optional[int]
    log_level: int
    link_remap: bool
    network_lock: Optional[str]
    passthrough: list[str]


@dataclass(frozen=True)
class CriuOptions:
    """CRIU options, named as in `criu dump` / `podman container checkpoint`.

    ``leave_running``: the tree keeps running after the dump. ``leave_stopped``: it stays stopped
    (SIGSTOP) after the dump, so the caller decides whether to kill it or let it go on; the dump
    pipeline uses it so that the image can be published before the original is killed.
    ``timeout``: seconds CRIU waits for the tree to freeze.
    """

    leave_running: bool = False
    leave_stopped: bool = False
    tcp_established: bool = False
    shell_job: bool = False
    file_locks: bool = False
    ext_unix_sk: bool = False
    external: tuple[str, ...] = ()
    timeout: Optional[int] = None
    log_level: int = DEFAULT_LOG_LEVEL
    # Unlinked files the tree still has open (multiprocessing's spawn/forkserver semaphores in
    # /dev/shm are the common case) are linked back under a temporary name at dump and unlinked
    # again at restore. Without it CRIU refuses such a tree ("Can't create link remap").
    link_remap: bool = True
    # How CRIU blocks the network around a dump of established TCP connections: "nftables"
    # (libnftables, no binary needed), "iptables" (needs the iptables binary in CRIU's netns),
    # "skip". None: nftables when CRIU supports it, else iptables.
    network_lock: Optional[str] = None
    # Restore only: (key, fd) pairs handed to the restored tree as CRIU's --inherit-fd (e.g. a
    # new file for a stdout pipe whose reader is gone).
    inherit_fd: tuple[tuple[str, int], ...] = ()
    # Restore only: leave the private anonymous memory to a `criu lazy-pages` daemon (it must be
    # listening in the restore's work directory: LazyPagesDaemon).
    lazy_pages: bool = False
    # Restore only: established TCP connections come back closed (CRIU's --tcp-close), for a copy
    # restored beside the original that still holds them.
    tcp_close: bool = False
    # CRIU options passed through unchanged (``--criu-opt``), checked by criupass.parse: the
    # lines of the configuration file CRIU reads after the RPC settings.
    passthrough: tuple[str, ...] = ()

    def to_dict(self) -> CriuOptionsRecord:
        return {
            "leave_running": self.leave_running,
            "leave_stopped": self.leave_stopped,
            "tcp_established": self.tcp_established,
            "shell_job": self.shell_job,
            "file_locks": self.file_locks,
            "ext_unix_sk": self.ext_unix_sk,
            "external": list(self.external),
            "timeout": self.timeout,
            "log_level": self.log_level,
            "link_remap": self.link_remap,
            "network_lock": self.network_lock,
            "passthrough": list(self.passthrough),
        }


def _apply_options(opts: Any, options: CriuOptions) -> None:
    """Copy our options into pycriu's ``criu_opts`` protobuf message."""
    opts.leave_running = options.leave_running
    if options.leave_stopped:
        opts.leave_stopped = True
    opts.tcp_established = options.tcp_established
    opts.shell_job = options.shell_job
    opts.file_locks = options.file_locks
    opts.ext_unix_sk = options.ext_unix_sk
    for ext in options.external:
        opts.external.append(ext)
    if options.timeout:
        opts.timeout = int(options.timeout)
    opts.log_level = options.log_level
    opts.link_remap = options.link_remap
    method = options.network_lock or default_network_lock()
    opts.network_lock = _NETWORK_LOCKS[method]
    if options.lazy_pages:
        opts.lazy_pages = True
    if options.tcp_close:
        opts.tcp_close = True
    for key, fd in options.inherit_fd:
        item = opts.inherit_fd.add()
        item.key = key
        item.fd = fd


# criu_network_lock_method in CRIU's rpc.proto
_NETWORK_LOCKS = {"iptables": 1, "nftables": 2, "skip": 3}
NETWORK_LOCKS = tuple(_NETWORK_LOCKS)


def default_network_lock() -> str:
    """nftables unless only the iptables binary is there: the nftables lock needs no binary."""
    return "iptables" if shutil.which("iptables") and not has_nftables() else "nftables"


def has_nftables() -> bool:
    """libnftables is installed: CRIU can lock the network without any binary."""
    import ctypes.util

    return ctypes.util.find_library("nftables") is not None
