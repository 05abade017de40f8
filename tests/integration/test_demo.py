"""`npusnap demo` end to end: the README's main job must pass its own continuity check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_root

NPUSNAP = str(Path(sys.executable).parent / "npusnap")


@pytest.mark.integration
@requires_root
@pytest.mark.parametrize(
    "workload", [["--workload", "compute", "--hidden", "32"], ["--workload", "memory", "--param-mib", "4"]]
)
def test_demo_round_trip_keeps_continuity(
    tmp_path: Path, sim_env: dict[str, str], workload: list[str]
) -> None:
    """Both workloads: npu_train.py (aclnn operators, the default) and train.py."""
    work = tmp_path / "demo"
    proc = subprocess.run(
        [
            NPUSNAP,
            "demo",
            "--steps",
            "20",
            "--dump-after",
            "4",
            "--interval",
            "0.05",
            *workload,
            "--workdir",
            str(work),
            "--keep",
            "--json",
        ],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    envelope = json.loads(proc.stdout)
    assert proc.returncode == 0, envelope["error"]
    result = envelope["result"]
    assert envelope["ok"] and result["continuity"] is True
    assert result["lines_total"] == result["reference_lines"] == 20
    assert 4 <= result["lines_before_dump"] < 20
    assert result["restored_pid"] == result["original_pid"]
    # --keep leaves a complete image that verifies.
    verify = subprocess.run([NPUSNAP, "verify", result["image"]], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stderr
