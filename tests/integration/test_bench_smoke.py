"""Smoke test of the benchmark (bench/run.py), so that it cannot rot: tiny sizes, one repetition.

It checks that the report has every table and that the run cleaned up after itself. It asserts
no timing: benchmarks are not tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, requires_root

pytestmark = [pytest.mark.integration, requires_root]

TABLE_HEADINGS = (
    "## Machine and versions",
    "## Dump: npusnap against raw CRIU",
    "### Frozen time, by phase",
    "### --leave-running",
    "## Restore: npusnap against raw CRIU",
    "## Image write rate against the disk",
    "## Cold memory",
    "## CLI start-up",
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
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    text = out.read_text()
    for heading in TABLE_HEADINGS:
        assert heading in text, f"{heading!r} missing from the report"
    # One row per size in each per-size table (dump, frozen, CRIU alone, leave-running, restore, write rate).
    assert text.count("| 16 MiB |") == 6, text
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
