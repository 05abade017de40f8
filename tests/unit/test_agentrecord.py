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
    assert rec == agentrecord.AgentRecord(pid=preloaded.pid, opened=0, tracking=True)
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


def test_an_agent_loaded_after_libc_says_it_counts_nothing() -> None:
    """Loaded by dlopen (as attach and a Python start() without LD_PRELOAD load it), the agent's
    wrappers see none of the process's calls: its record says so, and nothing is concluded."""
    lib = native.library_path(include_mapped=False)
    code = f"import ctypes, time; ctypes.CDLL({str(lib)!r}); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        rec = agentrecord.read(p.pid)
        assert rec is not None and rec.pid == p.pid and not rec.tracking
        assert not agentrecord.never_opened_a_device(p.pid)
    finally:
        p.kill()
        p.wait()


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
