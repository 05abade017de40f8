"""Listeners a restore would take from a running process."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from npusnap_cli import criuimages
from npusnap_cli.errors import PreflightError
from npusnap_cli.host.hostres.nodes import _socket_inodes
from npusnap_cli.host.hostres.procfds import _all_pids, _comm

# CRIU binds a restored unix socket at its dumped path and first removes whatever socket file is
# there (criu/sk-unix.c, bind_unix_sk). After the original exited that is its stale file; while
# it still runs (a copy restored beside it: `restore` of a --pid-ns image, `--replicas`) the file
# is the original's live listener, and its clients then reach the copy. A DataLoader worker's
# multiprocessing listener (/tmp/pymp-*/listener-*) is such a socket: its main process fetches
# every batch's shared-memory fd through it, and a copy restored over it made the original fail
# ("Connection reset by peer"). The path is in the process's memory too, so a copy cannot bind
# it elsewhere; with a shared filesystem there is one listener per path.


def image_listeners(criu_dir: Path, skip: Iterable[Optional[str]] = ()) -> list[str]:
    """The filesystem paths the image's listening unix sockets are bound to (``skip``: the agent
    sockets, which a restore binds under a name of its own)."""
    skipped = {s for s in skip if s}
    try:
        sockets = criuimages.unix_sockets(criu_dir)
    except (OSError, criuimages.Undecodable):
        return []
    out = []
    for sk in sockets:
        # Listening streams only; the simulated device's connection is the device plugin's,
        # never bound by CRIU.
        name = sk.path
        if sk.listening_stream and name.startswith("/") and name not in skipped and name not in out:
            out.append(name)
    return out


def live_listeners(wanted: Iterable[str]) -> dict[str, tuple[int, str]]:
    """Of ``wanted`` paths, those a live process listens on now (in any network namespace of the
    host): path -> (pid, command name)."""
    want = set(wanted)
    if not want:
        return {}
    seen_ns: set[str] = set()
    found: dict[int, str] = {}  # socket inode -> path
    pids = _all_pids()
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        try:
            with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
                next(f, None)
                for line in f:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and int(fields[3], 16) & 0x10000:
                        path = fields[7].rstrip("\n")
                        if path in want:
                            found[int(fields[6])] = path
        except (OSError, ValueError):
            continue
    if not found:
        return {}
    out: dict[str, tuple[int, str]] = {}
    for pid in pids:
        for ino in _socket_inodes(pid) & set(found):
            path = found[ino]
            if path not in out and _same_file(path, pid):
                out[path] = (pid, _comm(pid))
    return out


def _same_file(path: str, pid: int) -> bool:
    """Whether ``path`` here is the file ``path`` is for ``pid`` (which may see another /tmp: a
    container's mount namespace)."""
    try:
        here = os.stat(path)
        there = os.stat(f"/proc/{pid}/root{path}")
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def check_listeners_free(criu_dir: Path, agent_sockets: Iterable[Optional[str]]) -> list[str]:
    """Refuse a restore whose CRIU would bind a unix socket over a live process's listener; the
    image's listener paths otherwise."""
    paths = image_listeners(criu_dir, agent_sockets)
    busy = live_listeners(paths)
    if busy:
        path, (pid, comm) = next(iter(busy.items()))
        raise PreflightError(
            f"pid {pid} ({comm}) listens on {path}, which the image's job binds too",
            why="CRIU binds a restored unix socket at its dumped path, replacing the socket file: "
            "the running process's clients would reach the restored copy instead (a DataLoader "
            "worker's multiprocessing listener, usually: the job's original, still running)",
            fix=f"stop pid {pid} (the original: `kill` it) and restore again; a job whose processes "
            "listen on unix socket paths restores once per host at a time, not beside itself",
            details={"busy_listeners": {p: {"pid": q, "comm": c} for p, (q, c) in busy.items()}},
        )
    return paths
