"""The restored tree: the options CRIU restores it with, the new reader of its pipes to outside,
and the watch on it once it runs again."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from npusnap_cli import criu, safefs
from npusnap_cli.errors import PreflightError, TargetError
from npusnap_cli.host import procfs
from npusnap_cli.image.manifest import Manifest


def criu_options(manifest: Manifest, inherit_fd: tuple[tuple[str, int], ...] = ()) -> criu.CriuOptions:
    """The options CRIU dumped the image with, as its restore needs them."""
    o = manifest.criu_options
    lock = o.get("network_lock")
    return criu.CriuOptions(
        tcp_established=bool(o.get("tcp_established")),
        shell_job=bool(o.get("shell_job")),
        file_locks=bool(o.get("file_locks")),
        ext_unix_sk=bool(o.get("ext_unix_sk")),
        external=tuple(str(x) for x in o.get("external") or ()),
        link_remap=bool(o.get("link_remap", False)),
        network_lock=lock if lock in criu.NETWORK_LOCKS else None,
        inherit_fd=inherit_fd,
    )


def open_pipe_targets(manifest: Manifest, pipe_to: Optional[Path]) -> list[tuple[str, int]]:
    """(CRIU key, fd) for each pipe recorded by dump --external-pipes, all opened on ``pipe_to``."""
    keys = sorted({e.key for e in manifest.external_stdio if e.kind == "pipe"})
    if not keys:
        return []
    if pipe_to is None:
        e = manifest.external_stdio[0]
        raise PreflightError(
            f"the image's pid {e.pid} wrote to a pipe to a process outside the tree (fd {e.fd})",
            why="the reader of that pipe is not in the image; restored as it was, the job would die "
            "of SIGPIPE at its next write",
            fix="rerun restore with --pipe-to FILE: the job then writes there",
            details={"external_stdio": [x.to_dict() for x in manifest.external_stdio]},
        )
    try:
        # No user's symlink on the way, no hard link; the file is ours or the job's user's.
        owners = {os.geteuid(), *(p.uid for p in manifest.processes if p.uid >= 0)}
        out = safefs.open_append(str(pipe_to), owners=owners)
    except OSError as exc:
        raise PreflightError(
            f"cannot open --pipe-to {pipe_to}: {exc.strerror}",
            fix="name a writable file (not a symlink) for the job's output",
        ) from None
    # The job gets a new pipe, not the file itself: CRIU re-opens an inherited pipe end through
    # /proc/self/fd with the pipe's flags, which would drop O_APPEND and start at offset 0 (the
    # job would overwrite the file). A detached `cat` is the pipe's new reader, as `tee` was.
    r, w = os.pipe()
    try:
        subprocess.Popen(
            ["cat"], stdin=r, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True
        )
    except OSError as exc:
        os.close(w)
        raise PreflightError(
            f"cannot start the reader for --pipe-to: {exc}", fix="check that cat is installed"
        ) from None
    finally:
        os.close(r)
        os.close(out)
    return [(key, w) for key in keys]


def become_subreaper() -> bool:
    """Make the restored tree's root our child once CRIU exits, so that we can read its exit
    status (a job that finished cleanly in the settle time is not a failed restore).

    Only for a short-lived process (the CLI): a long-lived one would collect zombies that hold
    the pids a later restore needs.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _exit_status(pid: int) -> Optional[int]:
    """The wait status of ``pid`` if it is our (subreaped) child and has exited, else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return status if got == pid else None


def check_alive_after(pids: tuple[int, ...], settle_s: float, log: str) -> list[str]:
    """Never report "running" of a process that died: watch the tree a moment after it resumed.

    The root is npusnap's child once CRIU exits (``become_subreaper``), so its exit status is
    known: a failure status fails the restore. Other processes that are gone are reported in
    the returned notes, as are clean exits.
    """
    end = time.monotonic() + settle_s
    statuses: dict[int, Optional[int]] = {}
    while True:
        for p in pids:
            if p not in statuses and not procfs.is_alive(p):
                statuses[p] = _exit_status(p)
        if len(statuses) == len(pids) or time.monotonic() >= end:
            break
        time.sleep(0.05)
    ok = [p for p, st in statuses.items() if st is not None and os.waitstatus_to_exitcode(st) == 0]
    unknown = [p for p, st in statuses.items() if st is None]
    dead = {p: st for p, st in statuses.items() if st is not None and p not in ok}
    if dead:
        how = "; ".join(f"{p}: {_describe_status(st)}" for p, st in dead.items())
        raise TargetError(
            f"the restored process(es) died right after resuming ({how})",
            why="they were restored but ended within the first moments: usually a resource "
            "restored as it was but no longer usable (a pipe whose reader is gone, a peer that "
            "went away, a file changed underneath it)",
            fix=f"read the job's own output/log and the CRIU log {log}; for pipes, dump with "
            "--external-pipes and restore with --pipe-to FILE",
            details={"dead_pids": sorted(dead), "criu_log": log},
        )
    notes = [f"pid {p} finished (exit status 0) right after the restore" for p in ok]
    notes += [
        f"pid {p} exited right after the restore (not npusnap's child: its exit status is unknown; "
        "see the job's output)"
        for p in unknown
    ]
    return notes


def _describe_status(status: Optional[int]) -> str:
    if status is None:
        return "gone (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"
