"""The kernel's page-cache counters around a timed command (``/proc/vmstat``).

Why a figure grows faster than its bytes is usually the page cache, not the program: a writer is
throttled to the disk's pace once dirty pages pass the kernel's dirty limit (``balance_dirty_pages``
lets it run free below ``(nr_dirty_threshold + nr_dirty_background_threshold) / 2``, the *free-run*
point), and a reader whose image was evicted reads it from the disk. ``Watch`` samples both while a
command runs, so that the report can say which sizes crossed the line instead of guessing. It also
takes the time waited on I/O from the kernel's pressure stall information (``/proc/pressure/io``),
shown beside them but no cause by itself: a dump command waits on I/O by design (npusnap's fsync,
raw CRIU's ``sync -f``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

PAGE = os.sysconf("SC_PAGE_SIZE")
# Fine enough to catch the peak of a dump's dirty pages (they rise for a second or more before
# throttling holds them), coarse enough to cost nothing measurable on a 2-core machine.
SAMPLE_S = 0.05
_KEYS = (
    "nr_dirty",
    "nr_writeback",
    "nr_dirty_threshold",
    "nr_dirty_background_threshold",
    "pgpgin",
    "pgsteal_kswapd",
    "pgsteal_direct",
)
_RECLAIM = ("pgsteal_kswapd", "pgsteal_direct")


PSI_IO = "/proc/pressure/io"


def io_stall_us() -> Optional[int]:
    """Microseconds that some task waited on I/O since boot (``/proc/pressure/io``, "some"), which
    includes a writer that ``balance_dirty_pages`` holds to the disk's pace; None without PSI."""
    try:
        with open(PSI_IO) as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def read() -> dict[str, int]:
    """The counters of ``_KEYS`` now (pages, except pgpgin: KiB read from block devices)."""
    out: dict[str, int] = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name in _KEYS:
                out[name] = int(value)
    return out


@dataclass(frozen=True)
class PageCacheUse:
    """What the page cache did while one command ran (bytes)."""

    peak_dirty: int  # the largest dirty + under-writeback seen (what balance_dirty_pages compares)
    freerun: int  # the smallest free-run point seen: above it, writers are throttled
    disk_read: int  # read from block devices (pgpgin)
    reclaimed: int  # memory the kernel reclaimed meanwhile (pgsteal, kswapd and direct)
    io_stall_s: Optional[float] = None  # time some task waited on I/O (PSI), None without PSI

    @property
    def throttled(self) -> bool:
        return self.peak_dirty > self.freerun


class Watch:
    """Samples /proc/vmstat every SAMPLE_S from start() to stop()."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._first: dict[str, int] = {}
        self._peak = 0
        self._freerun: Optional[int] = None
        self._io0: Optional[int] = None

    def _sample(self) -> dict[str, int]:
        v = read()
        self._peak = max(self._peak, v.get("nr_dirty", 0) + v.get("nr_writeback", 0))
        thresh, bg = v.get("nr_dirty_threshold"), v.get("nr_dirty_background_threshold")
        if thresh is not None and bg is not None:
            point = (thresh + bg) // 2
            self._freerun = point if self._freerun is None else min(self._freerun, point)
        return v

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def start(self) -> Watch:
        self._io0 = io_stall_us()
        self._first = self._sample()
        self._thread = threading.Thread(target=self._run, name="bench-vmstat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> PageCacheUse:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        last = self._sample()
        io0, io1 = self._io0, io_stall_us()
        return PageCacheUse(
            io_stall_s=(io1 - io0) / 1e6 if io0 is not None and io1 is not None else None,
            peak_dirty=self._peak * PAGE,
            freerun=(self._freerun or 0) * PAGE,
            disk_read=(last.get("pgpgin", 0) - self._first.get("pgpgin", 0)) * 1024,
            reclaimed=sum(
                last.get(k, 0) - self._first.get(k, 0) for k in ("pgsteal_kswapd", "pgsteal_direct")
            )
            * PAGE,
        )
