"""Smoke test of the benchmark (bench/run.py), so that it cannot rot: tiny sizes, one repetition.

It checks that the report has every table and that the run cleaned up after itself. It asserts
no timing: benchmarks are not tests.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, requires_root

# serial: its timings would measure the other tests of a parallel run, and beside them its
# cold-memory step failed to map the memory it warms ("mmap failed", EINVAL).
pytestmark = [pytest.mark.integration, requires_root, pytest.mark.serial]

TABLE_HEADINGS = (
    "## Machine and versions",
    "## Dump: npusnap against raw CRIU",
    "### Frozen time, by phase",
    "### --leave-running",
    "## Restore: npusnap against raw CRIU",
    "## Image write rate against the disk",
    "## Cold memory",
    "## CLI start-up",
    "## Copy rates: the simulated device against this machine's memcpy",
    "## Targets at 1 GiB and 4 GiB",
    "## Scale: with size and with the number of NPU processes",
    "### With the number of NPU processes",
    "## A job computing on the device",
    "## Assessment against the targets",
)


def _procs_under(path: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cwd"]):
        cwd = p.info.get("cwd") or ""
        if cwd.startswith(str(path)):
            found.append(p.pid)
    return found


def test_bench_runs_and_writes_every_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    images = tmp_path / "images"
    cmd = [sys.executable, str(REPO / "bench" / "run.py"), "--sizes", "16", "--reps", "1", "--out", str(out)]
    cmd += ["--host-mib", "8", "--disk-mib", "32", "--startup-runs", "2", "--image-dir", str(images)]
    cmd += ["--lazy-mib", "32"]
    cmd += ["--ranks", "1,2", "--ranks-mib", "24", "--copy-mib", "16"]
    plot = importlib.util.find_spec("matplotlib") is not None  # an optional dependency (.[bench])
    if not plot:
        cmd.append("--no-plot")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    text = out.read_text()
    for heading in TABLE_HEADINGS:
        assert heading in text, f"{heading!r} missing from the report"
    # One row per size in each per-size table (dump, frozen, CRIU alone, leave-running, restore,
    # write rate, scale, page cache).
    assert text.count("| 16 MiB |") == 8, text
    # The page cache during the dumps and restores (bench/vmstat.py): sampled, not left blank.
    row = r"\| 16 MiB \| \d+\.\d / \d+\.\d( \(throttled \d/1\))? \| \d+\.\d / \d+\.\d.*( \| \d+ / \d+){3} \|"
    assert re.search(row, text), text
    assert "| 32 MiB host + 64 MiB device |" in text  # the lazy-restore case (bench_lazy)
    # The trees of 1 and 2 ranks, each beside raw CRIU, with the per-process fit.
    assert "| 1 | 24 MiB |" in text and "| 2 | 12 MiB |" in text
    assert re.search(r"\| dump command \(raw: criu dump \+ sync\) \| npusnap \| -?\d+ \|", text), text
    assert re.search(r"\| memcpy \(host to host, this machine\) \| \d+\.\d\d \| 1\.00 \|", text), text
    if plot:
        png = out.with_name("benchmarks-scale.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "](benchmarks-scale.png)" in text
    assert "| `npusnap --help` |" in text and "| `npusnap status PID` |" in text
    if shutil.which("gdb") and shutil.which("cc"):
        assert "## Attach to a JAX-sized process" in text and "| Python 3 (gdb payload) |" in text, text
    assert "bench/run.py --sizes 16 --reps 1" in text  # the command that reproduces it

    # Clean: no image, workload or work area left behind, no process running in it.
    assert images.is_dir() and list(images.iterdir()) == []
    assert _procs_under(images) == []
    # The private simulated NPU daemon is stopped and its socket directory gone.
    m = re.search(r"private simulated NPU: .* at (\S+)", proc.stderr)
    assert m, proc.stderr[-2000:]
    sock = m.group(1)
    assert not Path(sock).parent.exists()
    daemons = [
        p.pid for p in psutil.process_iter(["cmdline"]) if sock in " ".join(p.info.get("cmdline") or [])
    ]
    assert daemons == []


def test_replicas_bench_runs_and_writes_its_table(tmp_path: Path) -> None:
    """bench/replicas.py at its smallest: 1 and 2 copies, restored and cold-started, all answer."""
    out = tmp_path / "replicas.md"
    cmd = [sys.executable, "-m", "bench.replicas", "--counts", "1,2", "--layers", "2", "--hidden", "256"]
    cmd += ["--warmup-batch", "2", "--framework", "none", "--repeat", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [ln for ln in out.read_text().splitlines() if re.match(r"^\| [12] \| ", ln)]
    assert len(rows) == 2, out.read_text()
