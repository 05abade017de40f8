"""The machine's floor for writing an image (bench/floor.py): the raw-CRIU workload writes the
bytes it holds with write() + fsync when asked, and cleans up after itself."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import floor
from bench.common import HOSTALLOC, BenchError


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "job.out"
    with open(log, "ab") as f:
        argv = [sys.executable, str(HOSTALLOC), "--mib", "8", "--interval", "0.02", *extra]
        proc = subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while "tick " not in log.read_text() and time.monotonic() < end:
        time.sleep(0.02)
    return proc, log


def test_the_workload_writes_its_bytes_times_both_phases_and_removes_the_file(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, "--floor-file", str(tmp_path / "floor.tmp"))
    try:
        first = floor.measure(proc, log, timeout=30)
        assert 0 < first.write_s <= first.durable_s
        assert not (tmp_path / "floor.tmp").exists()
        floor.measure(proc, log, timeout=30)  # asked again, it answers again
        assert proc.poll() is None and log.read_text().count("floor write_s") == 2
    finally:
        proc.kill()
        proc.wait()


def test_a_workload_that_cannot_answer_is_a_clear_error(tmp_path: Path) -> None:
    proc, log = _start(tmp_path)  # no --floor-file: SIGUSR1 ends it
    with pytest.raises(BenchError, match="exited"):
        floor.measure(proc, log, timeout=30)
    proc.wait()
