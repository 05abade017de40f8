"""Helpers for the agent tests: a private simulated NPU and a small NPU workload to drive.

Tests get the simulated NPU from the ``sim_env`` fixture (tests/conftest.py).

The workload is a plain Python script (ctypes only, any Python 3.9+) that claims a simulated
device, keeps a buffer in device memory and updates it deterministically every step, printing
``step N checksum C``. ``expected_checksum(N)`` recomputes the same sequence, so a test can check
that a process that was locked, backed up, restored or CRIU-restored still computes correctly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from npusnap_cli import contract, paths
from npusnap_cli.host.procfs import cmdline
from npusnap_cli.host.procfs import is_alive as alive

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
BUF = 256

WORKLOAD = r"""
import ctypes, os, sys, time
def say(*words):
    # One write(2) per line: with PYTHONUNBUFFERED (set on these machines) print() writes each
    # piece separately, and a forked child's line could land in the middle of the parent's.
    os.write(1, (" ".join(map(str, words)) + "\n").encode())
lib = ctypes.CDLL("libacl_rt.so")
def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} failed: {rc}")
lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
lib.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
check(lib.aclInit(None), "aclInit")
check(lib.aclrtSetDevice(int(os.environ.get("WL_DEVICE", "0"))), "aclrtSetDevice")
N = int(os.environ.get("WL_BUF", "256"))
dev = ctypes.c_void_p()
check(lib.aclrtMalloc(ctypes.byref(dev), N, 0), "aclrtMalloc")
host = (ctypes.c_uint8 * N)()
check(lib.aclrtMemcpy(dev, N, host, N, 1), "H2D")
hook_log = os.environ.get("WL_HOOK_LOG")
if hook_log:
    import npusnap_cli.agent as agent
    def make(stage):
        def hook():
            with open(hook_log, "a") as f:
                f.write(stage + "\n")
            nap = os.environ.get("WL_HOOK_SLEEP", "")
            if nap.startswith(stage + ":"):
                time.sleep(float(nap.split(":")[1]))
            fail = os.environ.get("WL_HOOK_FAIL_FILE")
            if fail and os.path.exists(fail) and open(fail).read().strip() == stage:
                raise RuntimeError("injected failure at " + stage)
        hook.__qualname__ = "hook_" + stage
        return hook
    for stage in agent.STAGES:
        agent.register_hook(stage, make(stage))
if os.environ.get("WL_START_AGENT") == "1":
    import npusnap_cli.agent as agent
    say("agent", agent.start())
if os.environ.get("WL_FORK") == "1":
    pid = os.fork()
    if pid == 0:
        say("child", os.getpid())
        if os.environ.get("WL_FORK_DEVICE") == "1":
            check(lib.aclrtSetDevice(int(os.environ.get("WL_DEVICE", "0"))), "aclrtSetDevice in the child")
            say("child-device", os.getpid())
        time.sleep(600)
        os._exit(0)
say("ready", os.getpid(), sys.version_info[0], sys.version_info[1])
step = 0
while True:
    check(lib.aclrtMemcpy(host, N, dev, N, 2), "D2H")
    for i in range(N):
        host[i] = (host[i] * 31 + step + i) % 251
    check(lib.aclrtMemcpy(dev, N, host, N, 1), "H2D")
    say("step", step, "checksum", sum(host))
    step += 1
    time.sleep(0.02)
"""


def expected_checksums(upto: int) -> list[int]:
    host = [0] * BUF
    out = []
    for step in range(upto + 1):
        host = [(host[i] * 31 + step + i) % 251 for i in range(BUF)]
        out.append(sum(host))
    return out


def python_versions() -> dict[str, str]:
    """Interpreters of pyenv by minor version ("3.9" -> path)."""
    found = {}
    base = Path.home() / ".pyenv" / "versions"
    if base.is_dir():
        for d in sorted(base.iterdir()):
            exe = d / "bin" / "python3"
            m = re.match(r"(3\.\d+)\.\d+$", d.name)
            if m and exe.exists():
                found[m.group(1)] = str(exe)
    return found


class Sim:
    """The session's simulated NPU (the ``sim_env`` fixture) and which device to give next.

    ``sim_env`` has 2 devices and a device is occupied by one live process at a time, so each test
    hands them out in turn from device 0 (its workloads are killed when it ends).
    """

    def __init__(self, env: dict[str, str], devices: int = 2) -> None:
        self.env = {k: env[k] for k in ("ASCEND_HOME_PATH", "LD_LIBRARY_PATH", "NPUSIM_SOCKET")}
        self.devices = devices
        self._next_device = 0

    def device(self) -> int:
        d = self._next_device % self.devices
        self._next_device += 1
        return d


class Workload:
    """A running workload whose stdout/stderr go to files (so CRIU can dump it: no pipes)."""

    def __init__(self, argv: list[str], env: dict[str, str], tmp: Path, name: str = "wl") -> None:
        self.out_path = tmp / f"{name}.out"
        self.err_path = tmp / f"{name}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=tmp,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.env = env

    def lines(self) -> list[str]:
        return self.out_path.read_text(errors="replace").splitlines()

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def agent_log(self) -> str:
        """What the agents of this workload logged (never its stderr): NPUSNAP_AGENT_LOG when
        `npusnap run` named it, else ``<runtime dir>/<pid>.log`` beside its socket."""
        path = self.env.get(contract.AGENT_LOG_ENV) or os.path.join(
            self.env.get(contract.AGENT_SOCKET_ENV_DIR) or str(paths.agent_runtime_dir()),
            contract.AGENT_LOG_NAME.format(pid=self.pid),
        )
        try:
            return Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, prefix: str, timeout: float = 20.0, after: int = 0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines()[after:]:
                if line.startswith(prefix):
                    return line
            if not alive(self.pid):
                break
            time.sleep(0.05)
        raise AssertionError(
            f"workload {self.pid} never printed {prefix!r}; stdout tail: {self.lines()[-5:]}; "
            f"stderr: {self.stderr()[-2000:]}"
        )

    def steps(self) -> list[tuple[int, int]]:
        out = []
        for line in self.lines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "step" and parts[2] == "checksum":
                out.append((int(parts[1]), int(parts[3])))
        return out

    def last_step(self) -> int:
        steps = self.steps()
        return steps[-1][0] if steps else -1

    def wait_steps(self, more: int = 3, timeout: float = 20.0) -> int:
        start = self.last_step()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.last_step() >= start + more:
                return self.last_step()
            if not alive(self.pid):
                break
            time.sleep(0.05)
        raise AssertionError(
            f"workload {self.pid} stopped stepping at {self.last_step()}: {self.stderr()[-2000:]}"
        )

    def assert_correct(self) -> None:
        steps = self.steps()
        assert steps, "no steps printed"
        expected = expected_checksums(steps[-1][0])
        numbers = [s for s, _ in steps]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "steps skipped or repeated"
        for step, checksum in steps:
            assert checksum == expected[step], f"step {step}: checksum {checksum} != {expected[step]}"

    def kill(self) -> None:
        kill_pid(self.pid)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def kill_pid(pid: int, marker: str = "workload.py") -> None:
    """SIGKILL ``pid`` if it still is one of our workloads (``marker`` in its command line).

    pid_max is 32768 here and the suite starts thousands of processes: a pid that exited may
    already belong to someone else (another test's process, the test runner's helpers).
    """
    if marker not in cmdline(pid):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def workload_env(sim: Sim, runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WL_", "NPUSNAP_AGENT"))}
    env.update(sim.env)
    env["NPUSNAP_RUNTIME_DIR"] = str(runtime_dir)
    env["WL_DEVICE"] = str(sim.device())
    env.update(extra)
    return env


def write_workload(tmp: Path) -> Path:
    path = tmp / "workload.py"
    path.write_text(WORKLOAD)
    return path


def wait_socket(runtime_dir: Path, pid: int, timeout: float = 15.0) -> Path:
    path = runtime_dir / f"{pid}.sock"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path
        time.sleep(0.05)
    raise AssertionError(f"no agent socket {path} after {timeout}s")


def start_agent_workload(
    sim: Sim, runtime_dir: Path, tmp: Path, started: list[Workload], name: str = "wl", **extra: str
) -> Workload:
    """Start the workload with an agent (``agent.start()``), record it in ``started`` and wait
    until it computes and its agent listens."""
    env = workload_env(sim, runtime_dir, PYTHONPATH=str(REPO), WL_START_AGENT="1", **extra)
    w = Workload([PY, str(write_workload(tmp))], env, tmp, name=name)
    started.append(w)
    w.wait_for("ready")
    wait_socket(runtime_dir, w.pid)
    return w
