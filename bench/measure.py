"""How the cases measure: the plan of a run, running npusnap and CRIU with a deadline and a clear
error, timing a restore until the job computes again, warming memory before a timed command, and
recording what the page cache did meanwhile (vmstat.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from bench import vmstat
from bench.common import (
    NPUSNAP,
    BenchError,
    MiB,
    Samples,
)
from bench.machine import mem_available, mem_free, mem_total
from bench.session import Session, TickWatcher
from npusnap_cli import criu as criu_mod

T = TypeVar("T")


def npusnap_json(args: list[str], env: dict[str, str], timeout: float) -> tuple[float, dict[str, Any]]:
    """Run ``npusnap ARGS --json``; (wall seconds, result). BenchError if it failed."""
    start = time.perf_counter()
    proc = subprocess.run(
        [str(NPUSNAP), *args, "--json"], env=env, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    try:
        envelope = json.loads(proc.stdout)
    except ValueError:
        envelope = None
    if proc.returncode != 0 or not envelope or not envelope.get("ok"):
        msg = (envelope or {}).get("error") or {"message": proc.stderr[-1500:]}
        raise BenchError(f"npusnap {shlex.join(args)} failed (exit {proc.returncode}): {msg.get('message')}")
    return wall, dict(envelope["result"])


def until_first_tick(
    s: Session, log: Path, pidfile: Path, script: str, run: Callable[[], T]
) -> tuple[T, float]:
    """Run ``run`` (a restore that writes ``pidfile``) and wait for the restored workload's next
    ``tick`` in ``log``: (run's result, seconds from its start until that tick). The restored pid
    is recorded for cleanup whatever happens."""
    watcher = TickWatcher(log)
    try:
        start = time.monotonic()
        try:
            result = run()
        finally:
            if pidfile.exists():
                s.restored.append((int(pidfile.read_text().strip()), script))
        watcher.wait_for(1, 60)
    finally:
        arrivals = watcher.stop()
    return result, arrivals[0] - start


def run_timed(cmd: list[str], what: str, log: Optional[Path] = None, timeout: float = 600) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        detail = proc.stderr[-800:]
        if log is not None and log.exists():
            detail += "\n" + "\n".join(criu_mod.log_excerpt(str(log), tail=15))
        raise BenchError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{detail}")
    return wall


def dir_bytes(path: Path, skip: tuple[str, ...] = ()) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name not in skip)


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    reps: int
    host_mib: int
    interval: float
    disk_mib: int
    startup_runs: int
    warm: bool = True
    lazy_mib: tuple[int, ...] = ()  # host MiB of the lazy-restore case (bench_lazy); empty: not run
    # The scale with processes: a tree of N ranks sharing ranks_mib MiB of device memory.
    ranks: tuple[int, ...] = (1, 2, 4)
    ranks_mib: int = 1024
    # The size of the memcpy / simulator copy-rate probe.
    copy_mib: int = 1024


def start_timeout(size_mib: int) -> float:
    # The workload fills its device memory before it is ready; allow for a slow, loaded machine.
    return 60.0 + size_mib / 10.0


def add_page_cache(
    out: Samples, size: int, what: str, use: vmstat.PageCacheUse, warmed_mib: Optional[int]
) -> None:
    """Record what the page cache did during one timed command (see vmstat.py), and how much
    memory was warmed right before it (what ``warm_memory`` returned; None, for a command not
    warmed for, records nothing)."""
    if warmed_mib is not None:
        out.add(size, f"{what}_warmed_bytes", warmed_mib * MiB)
    out.add(size, f"{what}_peak_dirty_bytes", use.peak_dirty)
    out.add(size, f"{what}_dirty_freerun_bytes", use.freerun)
    out.add(size, f"{what}_disk_read_bytes", use.disk_read)
    out.add(size, f"{what}_reclaimed_bytes", use.reclaimed)
    if use.io_stall_s is not None:
        out.add(size, f"{what}_io_stall_s", use.io_stall_s)
    out.flag(size, f"{what}_dirty_throttled", use.throttled)


# Runs in a fresh process: map SIZE MiB of anonymous memory, fill it with one memset and exit,
# which frees it again: the next allocations of the machine get pages the host has just backed.
_WARM = """
import ctypes as C, sys
size = int(sys.argv[1]) << 20
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
if addr in (None, C.c_void_p(-1).value):
    raise OSError(C.get_errno(), "mmap failed")
C.memset(addr, 1, size)
"""
# A cold dump waits this long first, with the machine's own free page reporting (bench/pagereport.py
# holds it off for the rest of the run): long enough for freed pages to go back to the host.
COLD_PAUSE_S = 4.0


def warm_reserve_mib() -> int:
    """What warming leaves available: the simulator keeps a gone process's memory for a faster
    Restore only while a fifth of the host's memory (at least 2 GiB) stays available
    (npusnap_sim/daemon.py), so warming past that would drop it; 512 MiB more keep clear of the line."""
    return max(2 * 1024, (mem_total() or 0) // MiB // 5) + 512


def warm_mib(plan: Plan, size: int) -> int:
    """What a dump or restore of ``size`` touches (process memory, backup, page cache), with margin.

    Capped at the available memory less ``warm_reserve_mib``, and at the free memory less 512 MiB
    (warming must not push the image out of the page cache before a restore). It was capped at
    half the available memory, and at 8 GiB that warmed less than the image's page cache alone:
    on this VM (free page reporting hands freed memory back to the host, which backs it again on
    first touch) raw ``criu dump`` of 8 GiB took 10-23 s unwarmed or half warmed, against 3.9-5.0 s
    fully warmed.
    """
    want = 3 * (size + plan.host_mib) + 512
    avail, free = (mem_available() or 0) // MiB, (mem_free() or 0) // MiB
    # Free memory only: warming must not evict the page cache (a restore's image is in it).
    return max(0, min(want, avail - warm_reserve_mib(), free - 512))


def warm_memory(plan: Plan, size: int) -> Optional[int]:
    """Touch and free memory right before a timed command, unless the plan says --cold.

    Returns the MiB warmed, for ``add_page_cache``; None when the plan says --cold.
    """
    if not plan.warm:
        return None
    mib = warm_mib(plan, size)
    if mib == 0:
        return 0  # no free memory to warm without evicting the page cache (mmap of 0 is EINVAL)
    proc = subprocess.run(
        [sys.executable, "-c", _WARM, str(mib)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"warming memory failed: {proc.stderr.strip()[-500:]}")
    return mib
