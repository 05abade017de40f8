"""One process's entries under /proc: alive, session, command line.

Standard library only and cheap to import: the simulator's manager, the CLI's pipelines, the
tests and the benchmark all ask these questions, often of a pid they remembered. pids are reused
(pid_max may be as low as 32768), so whoever kills a remembered pid checks its command line first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def state(pid: int) -> Optional[str]:
    """The state letter of a pid or thread id ("Z" a zombie, "X" dead), None once it is gone,
    "?" when it is there but unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, IndexError):
        return "?"


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a dead child not yet reaped still holds its pid)."""
    return state(pid) not in (None, "?", "Z", "X")


def stop_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, tracer pid) if ``pid`` is stopped or traced ('T'/'t'), else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            st = f.read().rsplit(")", 1)[1].split()[0]
        tracer = 0
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return (st, tracer) if st in ("T", "t") else None


def session_id(pid: int) -> Optional[int]:
    """The session id of ``pid`` as this pid namespace sees it (None when it is gone).

    0 means the session leader lives outside this pid namespace: the job was started by
    something outside the container (``docker exec``, ``nsenter``, a CI runner).
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # After the command name: state ppid pgrp session ...
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    """The command line of ``pid``, space-separated ("" when it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_time(pid: str = "self") -> Optional[int]:
    """Field 22 of /proc/PID/stat (clock ticks after boot). A CRIU restore gives a new value."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
        return int(data[data.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
