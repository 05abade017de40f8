"""The agent's own distribution (agent-dist/build_wheel.py) in an application's environment.

Built from this checkout, installed with pip (no index) into a fresh Python 3.9 virtualenv that
has none of the CLI's dependencies, it starts the native agent in a job on the simulated NPU,
and the CLI drives that job.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from npusnap_cli.device.agent_client import AgentClient
from tests.integration.agentlib import (
    REPO,
    Sim,
    Workload,
    python_versions,
    wait_socket,
    workload_env,
    write_workload,
)

pytestmark = pytest.mark.integration


def test_agent_wheel_installs_and_runs_on_python39(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    py39 = python_versions().get("3.9")
    if py39 is None:
        pytest.skip("no pyenv Python 3.9 on this host (~/.pyenv/versions/3.9.*)")
    built = subprocess.run(
        [py39, str(REPO / "agent-dist" / "build_wheel.py"), "--out", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    wheel = Path(built.stdout.strip())
    assert wheel.name.startswith("npusnap_agent-") and wheel.name.endswith(".whl")
    venv = tmp_path / "venv"
    subprocess.run([py39, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-index", str(wheel)], check=True, timeout=120
    )
    # Nothing of the CLI came along.
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u; print([u.find_spec(m) is None "
            "for m in ('typer', 'rich', 'psutil', 'npusnap_cli.cli')])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,  # not the checkout, which would be on sys.path as ''
    )
    assert probe.stdout.strip() == "[True, True, True, True]"

    env = workload_env(sim, runtime_dir, WL_START_AGENT="1")
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout
    w = Workload([str(venv / "bin" / "python"), str(write_workload(tmp_path))], env, tmp_path)
    workloads.append(w)
    w.wait_for("ready")
    wait_socket(runtime_dir, w.pid)
    with AgentClient(w.pid) as c:
        hello = c.hello()
        assert hello.agent == "native" and hello.python.version.startswith("3.9.")
        assert c.lock(lease_s=30).state == "LOCKED"
        assert c.unlock().state == "RUNNING"
    w.wait_steps(3)
    w.assert_correct()
