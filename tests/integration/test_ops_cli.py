"""What an operator's scripts rely on: `run --detach`, data on stdout, stale sockets cleaned."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from npusnap_cli.host import hostclean
from tests.integration.agentlib import (
    PY,
    REPO,
    Sim,
    kill_pid,
    wait_socket,
    workload_env,
    write_workload,
)

pytestmark = pytest.mark.integration
NPUSNAP = [PY, "-m", "npusnap_cli"]


def npusnap(env: dict[str, str], *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NPUSNAP, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_run_detach_prints_the_real_pid_and_status_is_greppable(
    sim: Sim, runtime_dir: Path, tmp_path: Path
) -> None:
    env = workload_env(sim, runtime_dir)
    pidfile = tmp_path / "job.pid"
    log = tmp_path / "job.log"
    workload = str(write_workload(tmp_path))
    proc = npusnap(
        env, "run", "--detach", "--pidfile", str(pidfile), "--output", str(log), "--", PY, workload
    )
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.strip())  # exactly one line on stdout: the pid
    try:
        assert pidfile.read_text() == f"{pid}\n"
        assert not list(tmp_path.glob(".job.pid.tmp*"))  # written atomically, nothing left over
        assert os.getsid(pid) == pid  # leads its own session: CRIU dumps it without --shell-job
        wait_socket(runtime_dir, pid)
        deadline = time.monotonic() + 20
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"ready {pid}" in log.read_text()  # the program's own pid, output appended to --output

        status = npusnap(env, "status", str(pid))
        assert status.returncode == 0, status.stderr
        rows = [ln for ln in status.stdout.splitlines() if "RUNNING" in ln]
        assert len(rows) == 1 and workload in rows[0]  # `npusnap status PID | grep RUNNING` works
        assert status.stderr == ""

        as_json = npusnap(env, "--json", "status", str(pid))
        env_out = json.loads(as_json.stdout)
        assert env_out["result"]["processes"][0]["pid"] == pid
    finally:
        kill_pid(pid)


def test_run_detach_refuses_a_bad_pidfile_before_starting(
    sim: Sim, runtime_dir: Path, tmp_path: Path
) -> None:
    env = workload_env(sim, runtime_dir)
    marker = tmp_path / "started"
    proc = npusnap(
        env, "--json", "run", "--detach", "--pidfile", str(tmp_path / "nodir" / "p"), "--",
        PY, "-c", f"open({str(marker)!r}, 'w')",
    )  # fmt: skip
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["kind"] == "usage"
    time.sleep(0.5)
    assert not marker.exists()  # nothing was started


def test_run_detach_reports_a_failed_exec(sim: Sim, runtime_dir: Path, tmp_path: Path) -> None:
    env = workload_env(sim, runtime_dir)
    script = tmp_path / "noexec.sh"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    proc = npusnap(env, "run", "--detach", "--", str(script))
    assert proc.returncode == 4 and proc.stdout == ""
    assert "cannot execute" in proc.stderr


def test_stale_agent_sockets_are_found_and_removed(runtime_dir: Path, tmp_path: Path) -> None:
    # A socket left by a process that is gone (as a CRIU dump leaves it): the pid is free.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = runtime_dir / f"{dead.pid}.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # bound, never listening: a leftover file
    # A live agent's socket (listening) must never be touched, even with a dead-looking pid.
    live_path = runtime_dir / "999999.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen(1)
    # Our own pid, socket newer than our start: not stale either.
    mine = runtime_dir / f"{os.getpid()}.sock"
    s2 = socket.socket(socket.AF_UNIX)
    s2.bind(str(mine))
    s2.close()
    try:
        found = {e.path: e.reason for e in hostclean.stale_agent_sockets([runtime_dir])}
        assert found == {str(stale): "its process is gone"}
        check = subprocess.run(
            [*NPUSNAP, "--json", "check"], capture_output=True, text=True, timeout=60, env=os.environ
        )
        debris = next(c for c in json.loads(check.stdout)["result"]["checks"] if c["name"] == "debris")
        assert debris["status"] == "warning"
        assert [d["path"] for d in debris["data"]["stale_sockets"]] == [str(stale)]
        assert stale.exists()  # check only reports
        status = subprocess.run(
            [*NPUSNAP, "status", str(os.getpid())], capture_output=True, text=True, timeout=60, env=os.environ
        )
        assert status.returncode == 0, status.stderr
        assert not stale.exists() and live_path.exists() and mine.exists()
    finally:
        live.close()


def test_an_agent_removes_its_socket_when_its_process_exits(runtime_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NPUSNAP_RUNTIME_DIR": str(runtime_dir)}
    code = "import npusnap_cli.agent as a; print(a.start(), flush=True)"
    proc = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.parent == runtime_dir  # it did serve a socket there
    assert not path.exists()  # and removed it at exit: /run/npusnap holds only live agents
