"""The machine's floor for writing an image: the raw-CRIU workload (hostalloc.py) writes the very
bytes it holds, from its own memory, into a file in the image directory with plain ``write()``
calls, then ``fsync``.

Why it exists: a dump's time grows with size partly because of the machine, not the program. On
this VM, writing into the page cache runs at memory speed until the dirty pages pass the kernel's
background threshold; from there writeback runs beside the writer and the writer slows to about
the disk's pace (by hand, no other process: the first 2 GiB at 3.9-4.3 GB/s, the rest at
1.6-1.8 GB/s; the disk takes 1.6-2.2 GB/s with O_DIRECT); and memory the host took back is backed
again on first touch (pagereport.py). None of that is CRIU's or npusnap's.

``bench_raw`` asks its workload for this floor right before the raw dump: the same memory held, so
the same dirty thresholds; the same bytes, read from the same memory as CRIU reads them. The scale
section fits each dump figure against the floor's write() time (``scale.floor_note``): a figure
linear in it grows as the machine does; one still super-linear against it has a term of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import BenchError

SIGNAL = signal.SIGUSR1  # what hostalloc.py --floor-file answers
_PREFIX = "floor write_s "


@dataclass(frozen=True)
class Floor:
    write_s: float  # the bytes written into the page cache (what a dump's frozen window holds)
    durable_s: float  # ... and made durable with fsync (what a dump command waits for)


def _answers(log: Path) -> list[Floor]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for ln in text.splitlines():
        if ln.startswith(_PREFIX):
            parts = ln.split()
            out.append(Floor(write_s=float(parts[2]), durable_s=float(parts[4])))
    return out


def measure(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> Floor:
    """Ask a hostalloc.py started with ``--floor-file`` (output in ``log``) for the floor, and
    wait for its answer; a clear error if it exits or does not answer in time."""
    before = len(_answers(log))
    os.kill(proc.pid, SIGNAL)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = _answers(log)
        if len(got) > before:
            return got[-1]
        if proc.poll() is not None:
            raise BenchError(f"the workload exited ({proc.returncode}) while writing the floor: see {log}")
        time.sleep(0.02)
    raise BenchError(f"timed out after {timeout:.0f} s waiting for the workload's floor write: see {log}")
