"""Never leave a job stopped if npusnap itself dies mid-dump.

A dump asks CRIU to leave the tree *stopped* (not killed) so that the original is killed only
once the image is safely on disk. That leaves one hole: if npusnap is SIGKILLed (or OOM-killed)
between the CRIU dump and the kill, nothing would ever resume the tree, and a stopped process
does not run its agent's lease either. ``StopGuard`` closes the hole with a tiny detached watcher
process (``stopguard_watch.py``) that resumes the tree when npusnap dies without saying
``done``; the leases then roll the device state back.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import IO, Optional

from npusnap_cli.host.procfs import start_time as read_start_time

WATCHER = Path(__file__).with_name("stopguard_watch.py")


class StopGuard:
    """Watch ``pids`` from a detached process until ``finish()`` (or resume them if we die)."""

    def __init__(self, pids: list[int], *, kill_restored: bool = False) -> None:
        """``kill_restored`` (restore): should npusnap die, the CRIU named with ``tell("criu",
        pid)`` and the tree it restored (``tell("tree", pid)``, and that CRIU's children) are
        killed instead of resumed: the tree was never verified nor released."""
        if kill_restored:
            args = ["--kill-restored"]
        else:
            args = [f"{p}:{s}" for p in pids if (s := read_start_time(str(p))) is not None]
        self._stdin: Optional[IO[bytes]] = None
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(WATCHER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives us and ignores the terminal's Ctrl-C
            close_fds=True,
        )
        self._stdin = self._proc.stdin

    @property
    def pid(self) -> int:
        return self._proc.pid

    def tell(self, kind: str, pid: int) -> None:
        """Name a process for the watcher (``criu``/``tree``, with its start time)."""
        start = read_start_time(str(pid))
        if self._stdin is None or start is None:
            return
        with contextlib.suppress(OSError):
            self._stdin.write(f"{kind} {pid}:{start}\n".encode())
            self._stdin.flush()

    def remove_on_death(self, path: Path) -> None:
        """Should npusnap die, remove its work area ``path`` too (once the tree is resumed)."""
        if self._stdin is None:
            return
        with contextlib.suppress(OSError):
            self._stdin.write(f"rm {path}\n".encode())
            self._stdin.flush()

    def finish(self) -> None:
        """We are exiting in an orderly way: the watcher has nothing to do."""
        if self._stdin is None:
            return
        with contextlib.suppress(OSError):
            self._stdin.write(b"done")
            self._stdin.close()
        self._stdin = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
