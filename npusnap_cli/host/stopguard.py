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

    def __init__(self, pids: list[int], *, kill_new: bool = False) -> None:
        """``kill_new`` (restore): ``pids`` do not exist yet; should npusnap die, the processes
        that take them after this call (CRIU's restored tree, left stopped) are killed instead."""
        if kill_new:
            args = ["--kill-new", *(f"{p}:new" for p in pids)]
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
