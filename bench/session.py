"""Processes of a benchmark run: start them, watch their ticks, clean everything up."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bench.common import NPUSNAP, POLL_S, BenchError, progress
from npusnap_cli.host import procfs
from npusnap_sim import manager
from npusnap_workloads.jaxsize import StepClock

# --------------------------------------------------------------------------------------------
# Processes: start, watch, clean up
# --------------------------------------------------------------------------------------------


def _wait(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")


def _ticks(path: Path) -> int:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for ln in text.splitlines() if ln.startswith("tick "))


class TickWatcher(StepClock):
    """Records when each new ``tick`` line appears in a workload's output file (a thread polls it)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, prefix=b"tick ", poll_s=POLL_S)

    def wait_for(self, count: int, timeout: float) -> None:
        _wait(lambda: len(self.arrivals) >= count, timeout, f"{count} new tick line(s) from the workload")


@dataclass
class Session:
    """What one benchmark run started, so that ``close`` can remove all of it."""

    tmp: Path  # short path for the sim socket and agent sockets (AF_UNIX: 108 bytes)
    work: Path  # images and workload output, on the filesystem measured
    env: dict[str, str]
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    restored: list[tuple[int, str]] = field(default_factory=list)  # (pid, script it must run)
    daemon_started: bool = False
    daemon_size: tuple[int, int] = (1, 0)  # (devices, capacity bytes) of the private simulator
    load: list[float] = field(default_factory=list)

    def sample_load(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.load.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def start(
        self,
        argv: list[str],
        out: Path,
        *,
        agent: bool,
        timeout: float,
        watch: Optional[list[Path]] = None,
    ) -> subprocess.Popen[bytes]:
        """Start a workload detached (own session, output appended: CRIU can dump and restore it)
        and wait for its second tick (in each of the ``watch`` files instead, for a tree whose
        ranks write their own output)."""
        cmd = [str(NPUSNAP), "run", "--", *argv] if agent else argv
        with open(out, "ab") as f:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=f,
                start_new_session=True,
                cwd=self.work,
            )
        self.children.append(proc)

        def ready() -> bool:
            if proc.poll() is not None:
                tail = out.read_text(errors="replace")[-1500:]
                raise BenchError(f"workload {shlex.join(argv)} exited with {proc.returncode}:\n{tail}")
            return all(_ticks(f) >= 2 for f in watch or [out])

        _wait(ready, timeout, f"workload {Path(argv[1]).name} to start")
        return proc

    def reap(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for a dumped original to exit (npusnap/CRIU killed it) so that its pid is free."""
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"pid {proc.pid} still runs after its dump, which should have ended it"
            ) from None

    def kill_all(self) -> None:
        for pid, script in self.restored:
            # A restored process is not our child; make sure the pid is still the one we restored.
            if procfs.is_alive(pid) and script in procfs.cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.children:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        end = time.monotonic() + 10
        while any(procfs.is_alive(pid) for pid, _ in self.restored) and time.monotonic() < end:
            time.sleep(0.02)
        self.children.clear()
        self.restored.clear()

    def wait_device_free(self) -> None:
        """The daemon frees a dead owner's device memory in its reaper (every 0.5 s); the next
        workload needs the capacity."""

        def free() -> bool:
            st = manager.status()
            return bool(st.get("running")) and int(st.get("bytes_used", 1)) == 0

        _wait(free, 15, "the simulated NPU to free the device memory of killed workloads")

    def drop_kept_memory(self, next_case: str = "raw CRIU") -> None:
        """Restart the private simulator if it keeps the memory of killed workloads for a Restore
        (npusnap_sim/daemon.py: up to POOL_TTL_S). No case may run beside what an earlier case left there:
        that shared memory (a device's, on hardware) shrinks the host's page cache and the kernel's
        dirty limit for whichever case comes next. At 8 GiB, an npusnap dump next to the 8 GiB an
        earlier case left took 12-17 s (frozen 12.5-13.1 s, warming and the dirty limit squeezed,
        9.7 GiB reclaimed) against 4.5 s without. A case's own restore still finds the memory its
        dump left (the simulator keeps it, as a device keeps its fixed memory)."""
        if not self.daemon_started:
            return
        st = manager.status()
        kept = sum(int(d.get("kept_for_restore") or 0) for d in st.get("devices", []))
        if not kept:
            return
        progress(f"restarting the simulated NPU: it keeps {kept >> 20} MiB for a Restore ({next_case} next)")
        self.wait_device_free()
        manager.stop()
        self.start_daemon(*self.daemon_size)

    def start_daemon(self, devices: int, capacity: int) -> None:
        """Start the private simulated NPU (its socket comes from the environment)."""
        self.daemon_size = (devices, capacity)
        manager.start(devices=devices, capacity_bytes=capacity)
        self.daemon_started = True

    def close(self) -> list[str]:
        """Remove everything; returns the problems met (cleanup goes on past each)."""
        problems: list[str] = []
        try:
            self.kill_all()
        except Exception as exc:
            problems.append(f"killing workloads: {exc}")
        if self.daemon_started:
            try:
                manager.stop()
            except Exception as exc:
                problems.append(f"stopping the private simulated NPU daemon: {exc}")
        for d in (self.work, self.tmp):
            shutil.rmtree(d, ignore_errors=True)
            if d.exists():
                problems.append(f"could not remove {d}")
        return problems
