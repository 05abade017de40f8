"""Pipes and terminals to a process outside the tree on stdin/stdout/stderr."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Optional

from npusnap_cli.errors import PreflightError
from npusnap_cli.host.hostres.procfds import _all_pids, _comm, _fd_links
from npusnap_cli.image.hostrecords import ExternalStdio


def _is_tty(target: str) -> bool:
    return target.startswith("/dev/pts/") or (target.startswith("/dev/tty") and target != "/dev/tty")


def find_external_stdio(tree: Iterable[int]) -> list[ExternalStdio]:
    """Pipes the tree shares with processes outside it, and terminals it has open."""
    pids = set(tree)
    ours = {os.getpid()}
    pipes: dict[str, list[tuple[int, int]]] = {}
    found: list[ExternalStdio] = []
    for pid in sorted(pids):
        for fd, target in sorted(_fd_links(pid).items()):
            if target.startswith("pipe:["):
                pipes.setdefault(target, []).append((pid, fd))
            elif _is_tty(target):
                found.append(ExternalStdio(pid=pid, fd=fd, key=target, kind="tty", peers=()))
    if pipes:
        holders: dict[str, set[int]] = {k: set() for k in pipes}
        for other in _all_pids():
            if other in pids or other in ours:
                continue
            for target in _fd_links(other).values():
                if target in holders:
                    holders[target].add(other)
        for key, users in pipes.items():
            if holders[key]:
                for pid, fd in users:
                    found.append(
                        ExternalStdio(pid=pid, fd=fd, key=key, kind="pipe", peers=tuple(sorted(holders[key])))
                    )
    return found


def stray_pipes(found: list[ExternalStdio]) -> list[ExternalStdio]:
    """Pipes to outside the tree on fds other than 0-2: restored without a reader (warned)."""
    return [e for e in found if e.kind == "pipe" and e.fd > 2]


def external_stdio_error(found: list[ExternalStdio], *, shell_job: bool) -> Optional[PreflightError]:
    """The refusal for pipes/terminals the restored job could not use, or None."""
    # Standard input/output/error are used by every job; a stray inherited pipe on another fd
    # (a CI runner's, a shell's) usually is not, so those are only warned about (stray_pipes).
    pipes = [e for e in found if e.kind == "pipe" and e.fd <= 2]
    ttys = [e for e in found if e.kind == "tty" and e.fd <= 2]
    if ttys and not shell_job:
        e = ttys[0]
        return PreflightError(
            f"pid {e.pid} has the terminal {e.key} open (fd {e.fd})",
            why="a job attached to a terminal can only be dumped as a shell job, and is restored "
            "onto the terminal `npusnap restore` runs in",
            fix="rerun with --shell-job, or start the job with its input and output redirected "
            "(`npusnap run -- CMD >>job.log 2>&1 </dev/null`)",
            details={"external_stdio": [x.to_dict() for x in ttys]},
        )
    if pipes:
        e = pipes[0]
        peers = ", ".join(f"{p} ({_comm(p)})" for p in e.peers)
        return PreflightError(
            f"pid {e.pid}'s fd {e.fd} is a pipe to a process outside the dumped tree: {peers}",
            why="CRIU re-creates the pipe at restore but not its other end, so the restored job "
            "dies of SIGPIPE at its next write (as `train.py | tee log` does)",
            fix="redirect the job's output to a file (`>>job.log 2>&1`), or rerun with "
            "--external-pipes and restore with --pipe-to FILE (the restored job writes there)",
            details={"external_stdio": [x.to_dict() for x in pipes]},
        )
    return None
