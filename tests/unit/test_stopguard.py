"""StopGuard: a tree left stopped by CRIU is resumed if npusnap dies, and left alone otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Optional

import pytest

from npusnap_cli.host.procfs import state
from npusnap_cli.host.stopguard import StopGuard


def wait_state(pid: int, want: set[str], timeout: float = 5.0) -> Optional[str]:
    deadline = time.monotonic() + timeout
    while (st := state(pid)) not in want and time.monotonic() < deadline:
        time.sleep(0.02)
    return st


@pytest.fixture
def stopped() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)
    assert wait_state(proc.pid, {"T"}) == "T"
    yield proc.pid
    proc.kill()
    proc.wait()


def test_resumes_the_tree_when_npusnap_dies(stopped: int) -> None:
    guard = StopGuard([stopped])
    assert guard._stdin is not None
    guard._stdin.close()  # what the kernel does when npusnap is SIGKILLed: EOF, no "done"
    assert wait_state(stopped, {"S", "R"}) in ("S", "R")


def test_leaves_the_tree_alone_after_an_orderly_exit(stopped: int) -> None:
    guard = StopGuard([stopped])
    guard.finish()
    time.sleep(0.5)
    assert state(stopped) == "T"
    assert subprocess.run(["kill", "-0", str(guard.pid)], capture_output=True).returncode != 0  # watcher gone


def test_ignores_a_reused_pid(stopped: int) -> None:
    # A start time that does not match: the pid now belongs to someone else, never signal it.
    from npusnap_cli.host import stopguard_watch

    stopguard_watch.watch({stopped: "1"})
    assert state(stopped) == "T"
