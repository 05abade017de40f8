"""`npusnap attach` against real Python processes of every installed version and in every state.

Each target is a real interpreter (pyenv 3.9-3.13; npusnap itself runs on 3.11) that prints a
numbered tick forever. A test attaches, then checks on the process itself: the agent answers
hello with the target's pid over its control socket, and the target keeps ticking (and a C call
it was blocked in finishes uninterrupted). The failure tests check the error kind, the exit code
and that the message says what to do.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli.device import attach
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import ExitCode, TargetError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NPUSNAP = [sys.executable, "-m", "npusnap_cli"]
VERSIONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
STATES = ("busy", "sleep", "cblock", "threads")

# The target program. Every state prints "tick N" regularly so that the test can see it still
# runs after the attach; "cblock" also reports how its long C call ended.
TARGET = r"""
import ctypes, os, sys, time
mode = sys.argv[1]
print("ready", os.getpid(), flush=True)
n = 0
def tick():
    global n
    n += 1
    print("tick", n, flush=True)
if mode == "busy":
    last = time.monotonic()
    while True:
        x = [str(i) for i in range(50)]
        if time.monotonic() - last > 0.2:
            last = time.monotonic()
            tick()
elif mode == "sleep":
    # The headline case: the workload sleeps most of the time.
    while True:
        time.sleep(5)
        tick()
elif mode == "cblock":
    libc = ctypes.CDLL(None)
    while True:
        t0 = time.monotonic()
        left = libc.sleep(3)  # a long C call: non-zero if a signal cut it short
        print("cdone", left, round(time.monotonic() - t0, 1), flush=True)
        tick()
elif mode == "threads":
    import threading, select
    def worker(k):
        while True:
            if k == 0:
                select.select([], [], [], 0.3)
            else:
                time.sleep(0.3)
    for k in range(3):
        threading.Thread(target=worker, args=(k,), daemon=True).start()
    while True:
        time.sleep(0.5)
        tick()
"""


def pyenv_python(version: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python3")))
    return found[-1] if found else None


class Target:
    """A running target program whose stdout lines are collected in the background."""

    def __init__(self, python: str, mode: str, tmp: Path) -> None:
        script = tmp / "target.py"
        script.write_text(TARGET)
        self.proc = subprocess.Popen(
            [python, "-u", str(script), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ),  # carries NPUSNAP_RUNTIME_DIR from the fixture
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for(lambda ln: ln.startswith("ready"), 10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.strip())
                self._cond.notify_all()

    def wait_for(self, pred: object, timeout: float, after: int = 0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ln in self.lines[after:]:
                    if pred(ln):  # type: ignore[operator]
                        return ln
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"target {self.pid}: no matching line; output so far: {self.lines}")
                self._cond.wait(left)

    def ticks(self) -> list[int]:
        with self._cond:
            return [int(ln.split()[1]) for ln in self.lines if ln.startswith("tick ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def targets() -> Iterator[list[Target]]:
    started: list[Target] = []
    yield started
    for t in started:
        try:
            os.kill(t.pid, signal.SIGCONT)
        except OSError:
            pass
        t.kill()


def assert_keeps_running(target: Target, mode: str) -> None:
    """The target is alive and produces new ticks after the attach (and its C call was not cut)."""
    mark = len(target.lines)
    last = max(target.ticks(), default=0)
    wait = 8 if mode == "sleep" else 6
    target.wait_for(lambda ln: ln.startswith("tick ") and int(ln.split()[1]) > last, wait, after=mark)
    assert target.proc.poll() is None
    if mode == "cblock":
        done = target.wait_for(lambda ln: ln.startswith("cdone"), 6)
        assert done.split()[1] == "0", f"the C call was interrupted: {done}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", STATES)
def test_attach_starts_agent(
    version: str, mode: str, runtime_dir: Path, tmp_path: Path, targets: list[Target]
) -> None:
    python = pyenv_python(version)
    if python is None:
        pytest.skip(f"Python {version} is not installed under ~/.pyenv/versions")
    target = Target(python, mode, tmp_path)
    targets.append(target)
    if mode in ("sleep", "cblock"):
        time.sleep(0.3)  # let it get into its sleep / C call
    workdirs = set(glob.glob("/tmp/npusnap-attach-*"))
    started = time.monotonic()
    result = attach.attach(target.pid, timeout=10)
    took = time.monotonic() - started
    assert set(glob.glob("/tmp/npusnap-attach-*")) <= workdirs, "per-attach files were left behind"

    assert result.method == "gdb"
    assert result.python == version
    assert result.hello.pid == target.pid
    assert result.socket and Path(result.socket).parent == runtime_dir
    if mode == "sleep":
        # A target that sleeps 5 s at a time must not make us wait for it to wake up.
        assert took < 4, f"attach took {took:.1f}s on a sleeping target ({result.safe_point})"
    with AgentClient(target.pid, timeout=5) as client:
        assert client.hello().pid == target.pid
    assert_keeps_running(target, mode)


def test_attach_cli_json_and_second_attach_is_noop(
    runtime_dir: Path, tmp_path: Path, targets: list[Target]
) -> None:
    python = pyenv_python("3.10") or sys.executable
    target = Target(python, "sleep", tmp_path)
    targets.append(target)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    first = subprocess.run(
        [*NPUSNAP, "attach", str(target.pid), "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert first.returncode == 0, first.stderr
    envelope = json.loads(first.stdout)
    assert envelope["ok"] is True and envelope["command"] == "attach"
    assert envelope["result"]["pid"] == target.pid
    assert envelope["result"]["hello"]["pid"] == target.pid
    assert envelope["result"]["safe_point"].startswith(("syscall:", "breakpoint:"))

    second = subprocess.run(
        [*NPUSNAP, "attach", str(target.pid), "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["result"]["method"] == "already-present"
    assert_keeps_running(target, "sleep")


def test_attach_refuses_stopped_target_and_leaves_it_stopped(
    runtime_dir: Path, tmp_path: Path, targets: list[Target]
) -> None:
    target = Target(pyenv_python("3.12") or sys.executable, "sleep", tmp_path)
    targets.append(target)
    os.kill(target.pid, signal.SIGSTOP)
    time.sleep(0.2)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [*NPUSNAP, "attach", str(target.pid), "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == int(ExitCode.TARGET)
    error = json.loads(proc.stdout)["error"]
    assert "stopped" in error["message"]
    assert f"kill -CONT {target.pid}" in error["fix"]
    # We did not resume it behind the user's back.
    assert attach._proc_state(target.pid) == "T"
    os.kill(target.pid, signal.SIGCONT)
    assert_keeps_running(target, "sleep")


def test_attach_refuses_non_python_process(targets: list[Target]) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(TargetError) as info:
            attach.attach(proc.pid, timeout=5)
        assert "not a Python process" in info.value.message
        assert info.value.exit_code == ExitCode.TARGET
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_attach_refuses_missing_pid() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [*NPUSNAP, "attach", "999999999"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == int(ExitCode.TARGET)
    assert "no process with pid 999999999" in proc.stderr


def test_attach_diagnostic_when_no_safe_point(tmp_path: Path) -> None:
    """A thread spinning in C without syscalls offers no safe point: a clear error, job unharmed."""
    src = tmp_path / "spin.c"
    src.write_text("int main(void){volatile unsigned long n=0; for(;;) n++; return 0;}\n")
    exe = tmp_path / "python3.12"  # looks like a Python by name, but has no libpython/symbols
    subprocess.run(["cc", "-O0", "-o", str(exe), str(src)], check=True)
    proc = subprocess.Popen([str(exe)])
    try:
        time.sleep(0.2)
        target = attach.probe(proc.pid)
        with pytest.raises(Exception) as info:
            attach.inject(target, "_report({'ok': True})", timeout=3)
        err = info.value
        assert getattr(err, "exit_code", None) == ExitCode.AGENT
        details = err.details  # type: ignore[attr-defined]
        assert details["threads"] and details["threads"][0]["tid"] == proc.pid
        assert details["gdb_report"]["ok"] is False
        assert "safe point" in (details["gdb_report"]["detail"] or "")
        assert proc.poll() is None, "the target must keep running"
        assert attach._proc_state(proc.pid) == "R"
    finally:
        proc.kill()
        proc.wait()


def test_attach_python314_remote_exec(runtime_dir: Path, tmp_path: Path, targets: list[Target]) -> None:
    python = pyenv_python("3.14")
    if python is None:
        pytest.skip("Python 3.14 is not installed here: the sys.remote_exec path cannot be exercised")
    target = Target(python, "busy", tmp_path)
    targets.append(target)
    result = attach.attach(target.pid, timeout=10)
    assert result.method == "remote_exec"
    assert result.hello.pid == target.pid
    assert_keeps_running(target, "busy")
