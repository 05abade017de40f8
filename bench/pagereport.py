"""The VM's free page reporting during a benchmark run: hold freed memory back from the host.

A VM whose balloon reports free pages hands memory the guest freed back to its host, and the
host backs it again on the next write, at a fraction of memory speed. Warming memory before a
timed command (``measure.warm_memory``) only helps while the warmed pages stay backed; on these
VMs the kernel's ``page_reporting`` module reports a page as soon as it has been free for
``min_free_ms`` (0 here), so a warmed page could go back to the host in the fraction of a
second between the warming and the command. That race decided which repetitions were slow:
an npusnap dump of 1 GiB right after the simulator restarted took 0.26-1.45 s (lock phase; 2
of 6 slow) with ``min_free_ms`` 0, and 0.26-0.28 s (8 of 8) with 10000.

``Hold`` raises ``min_free_ms`` to HOLD_MS for the run (the run's own warming then holds) and
puts the machine's value back at the end; ``released`` gives the machine's value back for the
*cold memory* case, which measures exactly what reporting costs a dump. Machines without the
module (bare metal, other hypervisors) are left alone. ``bench/run.py --keep-page-reporting``
leaves the value as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

PARAM = Path("/sys/module/page_reporting/parameters/min_free_ms")
# Longer than any timed command's warm-to-end (the largest dump takes seconds), shorter than a
# case's set-up, so memory freed between cases still goes back to the host.
HOLD_MS = 10_000


def _read(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _write(path: Path, value: int) -> bool:
    try:
        path.write_text(f"{value}\n")
    except OSError:
        return False
    return _read(path) == value


def current(path: Path = PARAM) -> Optional[int]:
    """The machine's ``min_free_ms`` now, or None without the module."""
    return _read(path)


class Hold:
    """Free page reporting held off for HOLD_MS during a run (see the module's docstring)."""

    def __init__(self, path: Path = PARAM) -> None:
        self.path = path
        self.original: Optional[int] = None
        self.held = False

    def start(self) -> str:
        """Hold reporting off; returns a line for the report's machine table."""
        self.original = _read(self.path)
        if self.original is None:
            return "no free page reporting module (nothing to hold)"
        if self.original >= HOLD_MS:
            return f"min_free_ms {self.original} (memory stays backed for that long after it is freed)"
        if not _write(self.path, HOLD_MS):
            return f"min_free_ms {self.original}: could not be raised (warmed memory may go back to the host)"
        self.held = True
        return (
            f"min_free_ms {self.original}, held at {HOLD_MS} during the run (a freed page goes back to "
            f"the host only after {HOLD_MS // 1000} s free, so the warming before each command holds; "
            f"{self.original} again for the cold-memory case and after the run)"
        )

    def stop(self) -> Optional[str]:
        """Put the machine's value back; a problem to report, or None."""
        if not self.held or self.original is None:
            return None
        self.held = False
        if not _write(self.path, self.original):
            return f"could not put {self.path} back to {self.original}: write it by hand"
        return None

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The machine's own value meanwhile (the cold-memory case), held again afterwards."""
        if not self.held or self.original is None:
            yield
            return
        _write(self.path, self.original)
        try:
            yield
        finally:
            _write(self.path, HOLD_MS)
