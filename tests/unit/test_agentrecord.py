"""The agent's device record, read from outside through /proc/PID/mem (host/agentrecord.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from npusnap_cli.agent import native
from npusnap_cli.host import agentrecord, procfs


@pytest.fixture
def preloaded() -> subprocess.Popen[bytes]:
    """A process with the agent library loaded (no CANN runtime, no device)."""
    lib = native.library_path(include_mapped=False)
    env = dict(os.environ, LD_PRELOAD=str(lib))
    env.pop("NPUSNAP_AGENT", None)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    deadline = time.monotonic() + 10
    while agentrecord.read(p.pid) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    yield p
    p.kill()
    p.wait()


def test_the_record_of_a_process_that_opened_nothing(preloaded: subprocess.Popen[bytes]) -> None:
    rec = agentrecord.read(preloaded.pid)
    assert rec == agentrecord.AgentRecord(pid=preloaded.pid, opened=0)
    assert agentrecord.never_opened_a_device(preloaded.pid)
    # Stopped, it is read all the same (nothing of it runs).
    os.kill(preloaded.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while procfs.state(preloaded.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.state(preloaded.pid) == "T"
        assert agentrecord.never_opened_a_device(preloaded.pid)
    finally:
        os.kill(preloaded.pid, signal.SIGCONT)


def test_no_record_without_the_agent() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        assert agentrecord.read(p.pid) is None
        assert not agentrecord.never_opened_a_device(p.pid)
    finally:
        p.kill()
        p.wait()


def test_no_record_of_a_process_that_is_gone() -> None:
    assert agentrecord.read(2**22 + 7) is None
    assert not agentrecord.never_opened_a_device(2**22 + 7)
