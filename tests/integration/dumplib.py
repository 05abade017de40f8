"""Helpers for the dump/restore tests: start workloads the way CRIU can restore them, run the CLI.

Workloads are started detached (own session, stdin /dev/null, output *appended* to a file: CRIU
skips its size check only for O_WRONLY|O_APPEND files, and a pipe to pytest cannot be restored).
The test reaps the original (``Job.reap``) after a dump so that its pid is free for the restore;
a restored process is not our child, so it is watched through /proc and its output file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import psutil

from npusnap_cli.criu import find_criu
from npusnap_cli.host.procfs import cmdline
from npusnap_cli.host.procfs import is_alive as alive
from npusnap_cli.image import layout
from npusnap_sim import manager

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
NPUSNAP = str(Path(sys.executable).parent / "npusnap")
TRAIN = str(REPO / "npusnap_workloads" / "train.py")
LAUNCHER = str(REPO / "npusnap_workloads" / "launcher.py")
# Small and quick: a step every 50 ms, 64 KiB of parameters.
TRAIN_ARGS = ["--interval", "0.05", "--param-bytes", "65536"]

_reference_cache: dict[tuple[str, ...], list[str]] = {}


def _restore_env(key: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


@contextlib.contextmanager
def private_sim(devices: int, capacity_bytes: int, fault: Optional[str] = None) -> Iterator[dict[str, str]]:
    """A simulated NPU of its own: builds it, starts a daemon on a socket of its own, yields the
    environment for child processes (ASCEND_HOME_PATH, LD_LIBRARY_PATH, NPUSIM_SOCKET) and stops
    the daemon at the end. This process's own NPUSIM_SOCKET is left as it was meanwhile.
    ``fault``: the node's fault (the daemon's NPUSIM_NODE_FAULT; docs/simulator.md), which only
    the daemon's environment gets."""
    manager.ensure_built()
    # Not pytest's tmp_path: AF_UNIX paths are limited to 108 bytes and pytest's are long.
    sock_dir = Path(tempfile.mkdtemp(prefix="npusim-"))
    sock = str(sock_dir / "npusim.sock")
    saved = os.environ.get("NPUSIM_SOCKET")
    os.environ["NPUSIM_SOCKET"] = sock  # manager resolves the socket from the environment
    try:
        manager.start(devices=devices, capacity_bytes=capacity_bytes, fault=fault or "")
        env = dict(os.environ)
        env.update(manager.env())
    except BaseException:
        _restore_env("NPUSIM_SOCKET", saved)
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    _restore_env("NPUSIM_SOCKET", saved)
    try:
        yield env
    finally:
        os.environ["NPUSIM_SOCKET"] = sock
        try:
            manager.stop()
        finally:
            _restore_env("NPUSIM_SOCKET", saved)
            shutil.rmtree(sock_dir, ignore_errors=True)


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.03)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kill(pid: int) -> None:
    if pid and alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_until(lambda: not alive(pid), 10, f"pid {pid} to die")


def job_env(sim_env: dict[str, str], runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(sim_env)
    env["NPUSNAP_RUNTIME_DIR"] = str(runtime_dir)
    env.update(extra)
    return env


def unpaced(args: list[str]) -> list[str]:
    """A workload's arguments without its sleep between steps (``--interval 0``): for the
    uninterrupted reference run, whose numbers the sleep does not change."""
    out = list(args)
    if "--interval" in out:
        out[out.index("--interval") + 1] = "0"
    return out


def reference(env: dict[str, str], args: list[str]) -> list[str]:
    """The lines an uninterrupted train.py run prints (no interval: the output does not depend on it)."""
    key = tuple(args)
    if key not in _reference_cache:
        fast = unpaced(args)
        out = subprocess.run(
            [PY, TRAIN, *fast], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
        _reference_cache[key] = out.splitlines()
    return list(_reference_cache[key])


class Job:
    """A workload started with `npusnap run` (or directly), detached, output appended to a file."""

    def __init__(
        self,
        tmp: Path,
        env: dict[str, str],
        argv: list[str],
        *,
        agent: bool = True,
        truncate: bool = False,
        run_flags: tuple[str, ...] = (),
        **popen: Any,
    ) -> None:
        """``truncate``: open the output as a shell's ``>`` does (O_TRUNC, no O_APPEND; CRIU then
        checks its size at restore); ``run_flags``: options of `npusnap run`; ``popen``: more
        subprocess.Popen arguments (pass_fds...)."""
        self.out = tmp / "job.out"
        cmd = [NPUSNAP, "run", *run_flags, "--", *argv] if agent else argv
        with open(self.out, "wb" if truncate else "ab") as f:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=f,
                start_new_session=True,
                cwd=tmp,
                **popen,
            )
        self.pid = self.proc.pid
        self.restored_pid = 0
        # What identifies this job's processes (their script), so cleanup never kills a reused pid.
        self.marker = next((a for a in argv if a.endswith(".py")), argv[0])

    def lines(self) -> list[str]:
        return [
            ln for ln in self.out.read_text(errors="replace").splitlines() if ln.startswith(("step", "[rank"))
        ]

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_lines(self, n: int, timeout: float = 20.0) -> None:
        wait_until(
            lambda: len(self.lines()) >= n, timeout, f"{n} lines of output (have: {self.text()[-500:]})"
        )

    def reap(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        for pid in (self.restored_pid, self.pid):
            if pid and alive(pid) and self.marker in cmdline(pid):
                import psutil

                try:
                    kids = psutil.Process(pid).children(recursive=True)
                except psutil.Error:
                    kids = []
                for k in kids:
                    kill(k.pid)
                kill(pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def cli(
    env: dict[str, str], *args: str, timeout: float = 120, json_mode: bool = True
) -> tuple[int, Optional[dict[str, Any]], str]:
    """Run the npusnap CLI; (exit code, JSON envelope or None, stderr)."""
    argv = [NPUSNAP, *args] + (["--json"] if json_mode else [])
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # A hung command is a bug to chase: say where it hung before it is killed.
        try:
            where = hang_report(p.pid)
        except (psutil.Error, OSError, subprocess.SubprocessError) as exc:
            where = f"(no report: {exc})"
        p.kill()
        try:  # a helper it started may hold its output open: do not wait for that forever
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(its output stayed open 30 s after it was killed)"
        raise AssertionError(
            f"`npusnap {' '.join(args)}` still running after {timeout}s\n{where}\n"
            f"--- its stdout ---\n{out[-3000:]}\n--- its stderr ---\n{err[-3000:]}"
        ) from None
    envelope = json.loads(out) if json_mode and out.strip() else None
    return p.returncode, envelope, err


def hang_report(pid: int) -> str:
    """Where a process and its descendants are: the Python stacks of every thread (py-spy, of
    the dev dependencies) and each task's kernel stack."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    lines: list[str] = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        lines.append(f"=== pid {proc.pid}: {' '.join(argv)[:200]}")
        if spy and ("python" in Path(argv[0] if argv else "").name or argv[:1] == [NPUSNAP]):
            spied = subprocess.run(
                [str(spy), "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30
            )
            lines.append(spied.stdout + spied.stderr)
        for task in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
            with contextlib.suppress(OSError):
                stack = (task / "stack").read_text().strip().replace("\n", " | ")
                lines.append(f"  task {task.name} ({(task / 'comm').read_text().strip()}): {stack[:300]}")
    return "\n".join(lines)


def agent_state(pid: int) -> Optional[str]:
    from npusnap_cli.device.agent_client import AgentClient

    with AgentClient(pid) as c:
        state = c.status().state
    return None if state is None else str(state)


def assert_no_image(directory: Path) -> None:
    """Neither the image nor a work area next to it: a failed dump leaves nothing that looks like one."""
    assert not directory.exists(), f"{directory} exists after a failed dump"
    assert layout.temp_siblings(directory) == [], layout.temp_siblings(directory)


def continues_reference(lines: list[str], ref: list[str]) -> bool:
    """``lines`` is a contiguous slice of ``ref`` that runs to its end."""
    if not lines:
        return False
    try:
        start = ref.index(lines[0])
    except ValueError:
        return False
    return ref[start:] == lines


CRASHING_CRIU = """#!/bin/sh
# The real CRIU for everything but the RPC worker, which crashes (SIGSEGV) as soon as it starts.
if [ "$1" = swrk ]; then kill -SEGV $$; fi
exec {real} "$@"
"""


def crashing_criu(path: Path) -> Path:
    """A CRIU at ``path`` (for NPUSNAP_CRIU) that is the real one but for its RPC worker, which
    crashes at once: a CRIU that fails in the middle of a dump or restore."""
    path.write_text(CRASHING_CRIU.format(real=find_criu().path))
    path.chmod(0o755)
    return path
