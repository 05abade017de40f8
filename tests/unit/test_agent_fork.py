"""A forked child must never wait on a lock that the parent's agent thread held at fork time.

DataLoader workers and friends fork at any moment; a lock taken by another thread is copied
locked into the child, where its owner does not exist, so touching it would hang the child.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import npusnap_cli.agent as agent


def wait_exit(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    return None


@pytest.mark.timeout(60)
def test_child_does_not_inherit_held_agent_locks(runtime_dir: Path) -> None:
    assert agent.start() is not None
    held, release = threading.Event(), threading.Event()

    def hold_locks() -> None:  # what the agent thread may be doing at the moment of a fork
        with agent._hooks._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_locks)
    holder.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: register a hook and start its own agent, as an app would
            try:
                agent.register_hook("pre_lock", lambda: None)
                os._exit(0 if agent.start() else 3)
            finally:
                os._exit(4)
        code = wait_exit(pid, 10)
        if code is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert code == 0, "the forked child hung on a lock held by another thread at fork time"
    finally:
        release.set()
        holder.join()
        agent.stop()
