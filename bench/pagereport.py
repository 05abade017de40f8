"""The VM's free page reporting during a benchmark run: hold freed memory back from the host.

A VM whose balloon reports free pages hands memory the guest freed back to its host, and the
host backs it again on the next write, at a fraction of memory speed. Warming memory before a
timed command (``measure.warm_memory``) only helps while the warmed pages stay backed. These
VMs' ``page_reporting`` module reports a page once it has been free for ``min_free_ms`` (0
here), and also, whatever ``min_free_ms`` says, as soon as more than ``max_waiting_mib`` (1024
here) waits to be reported. Both decided which repetitions were slow:

- an npusnap dump of 1 GiB right after the simulator restarted took 0.26-1.45 s (lock phase; 2
  of 6 slow) with ``min_free_ms`` 0, and 0.26-0.28 s (8 of 8) with 10000;
- a plain ``write()`` of 1 GiB into the page cache right after warming 3.7 GiB (``floor.py``)
  took 0.27-0.33 s when fast and 1.2-2.3 s when slow, with the same pages allocated, no page
  fault, no reclaim and no compaction: ``perf`` put 83 % of the slow write in the kernel's copy
  into the new page-cache pages (``copy_folio_from_iter_atomic``), pages the host had taken back.
  Slow in 4 of 8 and 11 of 12 with the machine's values; 6 of 10 with ``min_free_ms`` 60000
  alone (warming frees more than 1024 MiB at once, which is reported at once); 1 of 12, twice,
  with 10000 and ``max_waiting_mib`` at the memory's size; 0 of 12 and 1 of 20 with 60000 and
  the memory's size.

``Hold`` raises both for the run (``HOLD_MS``, and the memory's size in MiB) and puts the
machine's values back at the end; ``released`` gives the machine's values back for the *cold
memory* case, which measures exactly what reporting costs a dump. Machines without the module
(bare metal, other hypervisors) are left alone. ``bench/run.py --keep-page-reporting`` leaves the
values as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from bench.machine import mem_total

PARAMS = Path("/sys/module/page_reporting/parameters")
# Longer than any timed command's warm-to-end (the largest dump takes seconds), and the most the
# module accepts here; memory freed between cases still goes back to the host a minute later.
HOLD_MS = 60_000
# The module's parameters the hold raises, in the order the report names them.
HELD = ("min_free_ms", "max_waiting_mib")


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


def current(params: Path = PARAMS) -> str:
    """The machine's values now, as the report's machine table says them."""
    got = {name: _read(params / name) for name in HELD}
    if got["min_free_ms"] is None:
        return "no free page reporting module"
    return ", ".join(f"{name} {v}" for name, v in got.items() if v is not None)


class Hold:
    """Free page reporting held off during a run (see the module's docstring)."""

    def __init__(self, params: Path = PARAMS, memory_mib: Optional[int] = None) -> None:
        self.params = params
        total = memory_mib if memory_mib is not None else (mem_total() or 0) >> 20
        # What each parameter is raised to: nothing freed is reported for HOLD_MS, however much.
        self.targets = dict(zip(HELD, (HOLD_MS, max(total, 1))))
        self.original: dict[str, int] = {}
        self.raised: dict[str, int] = {}

    def start(self) -> str:
        """Hold reporting off; returns a line for the report's machine table."""
        for name in self.targets:
            v = _read(self.params / name)
            if v is not None:
                self.original[name] = v
        if "min_free_ms" not in self.original:
            return "no free page reporting module (nothing to hold)"
        failed = []
        for name, target in self.targets.items():
            if name not in self.original or self.original[name] >= target:
                continue
            if _write(self.params / name, target):
                self.raised[name] = target
            else:
                failed.append(name)
        was = ", ".join(f"{k} {v}" for k, v in self.original.items())
        if failed:
            undone = self.stop()  # what was raised goes back; say it if that failed too
            return (
                f"{was}: {', '.join(failed)} could not be raised (warmed memory may go back to the host)"
                + (f"; {undone}" if undone else "")
            )
        if not self.raised:
            return f"{was} (freed memory stays backed for that long, however much is freed)"
        now = ", ".join(f"{k} {v}" for k, v in self.raised.items())
        return (
            f"{was}; held at {now} during the run (a freed page goes back to the host only after "
            f"{self.targets['min_free_ms'] // 1000} s free, however much was freed, so the warming "
            "before each command holds; the machine's values again for the cold-memory case and after "
            "the run)"
        )

    def stop(self) -> Optional[str]:
        """Put the machine's values back; a problem to report, or None."""
        problems = []
        for name in list(self.raised):
            del self.raised[name]
            if not _write(self.params / name, self.original[name]):
                path, value = self.params / name, self.original[name]
                problems.append(f"could not put {path} back to {value}: write it by hand")
        return "; ".join(problems) or None

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The machine's own values meanwhile (the cold-memory case), held again afterwards."""
        held = dict(self.raised)
        for name in held:
            _write(self.params / name, self.original[name])
        try:
            yield
        finally:
            for name, target in held.items():
                _write(self.params / name, target)
