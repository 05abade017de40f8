"""Pid files: checked before anything is started, written atomically.

`npusnap restore --pidfile F` and `npusnap run --detach --pidfile F` write the pid of the job
they started. A bad path is a usage error found before acting (never a job that runs, or stays
locked, while npusnap reports a failure); the file is written to a temporary sibling, fsynced and
renamed, so a reader never sees a partial pid.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from npusnap_cli import safefs
from npusnap_cli.errors import UsageError


def check(path: Path) -> None:
    """Refuse a pid file path that cannot be written (a usage error)."""
    parent = path.parent if str(path.parent) else Path(".")
    problem = ""
    if path.is_dir():
        problem = "it is a directory"
    elif not parent.is_dir():
        problem = f"its directory {parent} does not exist"
    elif not os.access(parent, os.W_OK | os.X_OK):
        problem = f"its directory {parent} is not writable"
    elif path.exists() and not path.is_file():
        problem = "it exists and is not a regular file"
    if problem:
        raise UsageError(
            f"cannot write the pidfile {path}: {problem}",
            why="--pidfile is checked before anything is started",
            fix="pass a path in an existing, writable directory to --pidfile",
        )


def write(path: Path, pid: int) -> str:
    """Write ``pid`` and a newline atomically; UsageError if that fails after all.

    Through safefs: a random O_EXCL temporary name in the directory reached without following a
    user's symlink, then a rename within it (a name planted there is replaced, never followed)."""
    try:
        safefs.write_file(
            os.path.abspath(path),
            iter([f"{pid}\n".encode("ascii")]),
            mode=0o644,
            check=False,
            follow_root_links=True,
            fsync=True,
        )
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise UsageError(
            f"could not write the pidfile {path}: {exc.strerror}"
            + (f" ({exc.filename})" if isinstance(exc, safefs.UnsafePath) else ""),
            why="the disk is full"
            if full
            else "the pidfile's directory changed since it was checked, or a symbolic link a user "
            "could have made is on its path (root never writes through one)",
            fix=f"the process runs; its pid is {pid}",
        ) from None
    return str(path)
