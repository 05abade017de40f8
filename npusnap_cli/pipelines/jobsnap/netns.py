"""Network namespaces: a thread that enters one starts CRIU there."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from npusnap_cli.errors import PreflightError, StateUnknownError

CLONE_NEWNET = 0x40000000


def netns_id(pid: Optional[int] = None) -> str:
    """``net:[inode]`` of ``pid`` (or of this thread)."""
    where = (
        f"/proc/{pid}/ns/net" if pid is not None else f"/proc/self/task/{threading.get_native_id()}/ns/net"
    )
    return os.readlink(where)


def netns_name(ns: str) -> Optional[str]:
    """The /run/netns path (``ip netns``) bound to namespace ``ns``, if any."""
    run = Path("/run/netns")
    with contextlib.suppress(OSError):
        for entry in sorted(run.iterdir()):
            with contextlib.suppress(OSError):
                if f"net:[{os.stat(entry).st_ino}]" == ns:
                    return str(entry)
    return None


@contextlib.contextmanager
def in_netns(path: Optional[str]) -> Iterator[None]:
    """Run the body (in this thread only) inside the network namespace at ``path``."""
    if path is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PreflightError(
                f"cannot open the network namespace {path}: {exc.strerror}",
                fix="check the path (`ip netns list`; /proc/PID/ns/net of a process in it)",
            ) from None
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise PreflightError(
                    f"cannot enter the network namespace {path}: {os.strerror(err)}",
                    why="setns(CLONE_NEWNET) needs CAP_SYS_ADMIN",
                    fix="run npusnap as root",
                )
        finally:
            os.close(fd)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # pragma: no cover - our own namespace
                raise StateUnknownError(
                    "could not return to npusnap's own network namespace",
                    fix="rerun the command; the processes' states are reported above",
                )
    finally:
        os.close(own)
