"""SIGTERM during a command that waits on an agent returns in bounded time, rolls back what it
locked and says what state each process is in."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.agentlib import PY, REPO, Sim, Workload, wait_socket, workload_env, write_workload
from tests.integration.dumplib import NPUSNAP, agent_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_sigterm_while_freeze_waits_on_a_slow_hook(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """The agent is busy in a 4 s pre_lock hook when freeze gets SIGTERM: freeze stops waiting,
    rolls the process back as soon as the agent is free, exits 130 naming the state."""
    hook = tmp_path / "slowhook.py"
    hook.write_text(
        "import time\n"
        "import npusnap_cli.agent as agent\n"
        "agent.register_hook('pre_lock', lambda: time.sleep(4), name='slow')\n"
        "agent.start(hook_timeout_s=30)\n"
    )
    env = workload_env(sim, runtime_dir, PYTHONPATH=f"{tmp_path}:{REPO}", WL_START_AGENT="1")
    script = write_workload(tmp_path)
    script.write_text("import slowhook\n" + script.read_text())
    w = Workload([PY, str(script)], env, tmp_path)
    workloads.append(w)
    w.wait_for("ready")
    wait_socket(runtime_dir, w.pid)
    freeze = subprocess.Popen(
        [NPUSNAP, "freeze", str(w.pid), "--lease", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    t0 = time.monotonic()
    freeze.send_signal(signal.SIGTERM)
    out, err = freeze.communicate(timeout=30)
    took = time.monotonic() - t0
    assert freeze.returncode == 130, (out, err)
    assert took < 12, f"freeze took {took:.1f}s to return after SIGTERM"
    assert "SIGTERM" in err and "RUNNING" in err, err
    assert agent_state(w.pid) == "RUNNING"
    w.wait_steps(3)
    w.assert_correct()


@requires_root
def test_sigterm_while_dump_waits_on_a_slow_hook(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """The same for dump, signalled while the agent runs the hook: it stops waiting, rolls back
    once the agent is free, exits 130 and leaves no image."""
    started = tmp_path / "hook-started"
    hook = tmp_path / "slowhook.py"
    hook.write_text(
        "import time\n"
        "import npusnap_cli.agent as agent\n"
        "def slow():\n"
        f"    open({str(started)!r}, 'w').close()\n"
        "    time.sleep(4)\n"
        "agent.register_hook('pre_lock', slow, name='slow')\n"
        "agent.start(hook_timeout_s=30)\n"
    )
    env = workload_env(sim, runtime_dir, PYTHONPATH=f"{tmp_path}:{REPO}", WL_START_AGENT="1")
    script = write_workload(tmp_path)
    script.write_text("import slowhook\n" + script.read_text())
    w = Workload([PY, str(script)], env, tmp_path)
    workloads.append(w)
    w.wait_for("ready")
    wait_socket(runtime_dir, w.pid)
    img = tmp_path / "img"
    dump = subprocess.Popen(
        # The workload starts its agent itself (no preload): its device memory is the app's.
        [NPUSNAP, "dump", str(w.pid), str(img), "--device-memory", "app"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline and dump.poll() is None, "dump never reached the pre_lock hook"
        time.sleep(0.05)
    t0 = time.monotonic()
    dump.send_signal(signal.SIGTERM)
    out, err = dump.communicate(timeout=30)
    took = time.monotonic() - t0
    assert dump.returncode == 130, (out, err)
    assert took < 12, f"dump took {took:.1f}s to return after SIGTERM"
    assert not img.exists()
    assert agent_state(w.pid) == "RUNNING"
    w.wait_steps(3)
    w.assert_correct()
