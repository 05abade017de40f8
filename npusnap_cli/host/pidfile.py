"""Pid files: checked before anything is started, written atomically.

`npusnap restore --pidfile F` and `npusnap run --detach --pidfile F` write the pid of the job
they started. A bad path is a usage error found before acting (never a job that runs, or stays
locked, while npusnap reports a failure); the file is written to a temporary sibling, fsynced and
renamed, so a reader never sees a partial pid.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

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
    """Write ``pid`` and a newline atomically; UsageError if that fails after all."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{pid}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UsageError(
            f"could not write the pidfile {path}: {exc.strerror}",
            why="the pidfile's directory changed or filled up since it was checked",
            fix=f"the process runs; its pid is {pid}",
        ) from None
    return str(path)
