"""`npusnap demo` end to end: the README's main job must pass its own continuity check, with the
real torch_npu wheel (its default where the venv is built; CI builds it) and with the built-in
workloads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_workloads import demo
from tests.conftest import requires_root

NPUSNAP = str(Path(sys.executable).parent / "npusnap")


@pytest.mark.integration
@requires_root
@pytest.mark.parametrize(
    "workload",
    [
        ["--workload", "compute", "--hidden", "32"],
        ["--workload", "memory", "--param-mib", "4"],
        [],  # the default: torch_npu, the venv being there (the fixture fails under CI without it)
    ],
    ids=["compute", "memory", "torch_npu"],
)
def test_demo_round_trip_keeps_continuity(
    tmp_path: Path,
    sim_env: dict[str, str],
    runtime_dir: Path,
    workload: list[str],
    request: pytest.FixtureRequest,
) -> None:
    """npu_train.py, train.py, and by default an attention block trained by the real torch_npu."""
    if not workload:
        request.getfixturevalue("torch_npu_python")
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
        env={**sim_env, "NPUSNAP_RUNTIME_DIR": str(runtime_dir)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    envelope = json.loads(proc.stdout)
    assert proc.returncode == 0, envelope["error"]
    result = envelope["result"]
    assert envelope["ok"] and result["continuity"] is True
    assert result["workload"] == (workload[1] if workload else "torch_npu"), result
    assert result["torch_npu_unavailable"] is None
    if not workload:
        # the dump stopped a live training job: in a step's phase (or between steps), never after the end
        assert result["dump_caught"], result
        name, step = result["dump_caught"].split()[:2]
        assert name in ("idle", "h2d", "forward", "backward", "optimizer", "sync"), result
        assert 4 <= int(step) + 1 < 20, result
    assert result["lines_total"] == result["reference_lines"] == 20
    assert 4 <= result["lines_before_dump"] < 20
    assert result["restored_pid"] == result["original_pid"]
    # --keep leaves a complete image that verifies.
    verify = subprocess.run([NPUSNAP, "verify", result["image"]], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stderr


def test_auto_says_why_without_the_torch_npu_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where setup-torch-npu.sh could not build the venv, the demo names the reason it left."""
    monkeypatch.setattr(paths, "build_dir", lambda: tmp_path)
    python, why = demo.torch_npu_python()
    assert python is None and "was not built by scripts/setup-torch-npu.sh" in why
    (tmp_path / "torch-npu.why").write_text("pip could not install torch==2.13.0+cpu\nset the spec\n")
    assert demo.torch_npu_python() == (None, "pip could not install torch==2.13.0+cpu")
    venv = tmp_path / "torch-npu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".npusnap-ok").write_text("spec\n")
    assert demo.torch_npu_python() == (venv / "bin" / "python", "")
