"""The in-target agent against real processes and the simulated NPU.

Each test starts a real workload (ctypes over the simulator's libacl_rt.so) and talks to its
agent through the real AgentClient; outcomes are checked on the process itself (its snapshot
state, its socket, and that it keeps computing the right numbers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli import paths, replies
from npusnap_cli.agent import native
from npusnap_cli.device.agent_client import AgentClient, AgentDeviceError, AgentOpError
from npusnap_cli.errors import AgentError, BusyError
from tests.conftest import requires_root
from tests.integration.agentlib import (
    PY,
    REPO,
    Sim,
    Workload,
    alive,
    kill_pid,
    start_agent_workload,
    wait_socket,
)

pytestmark = pytest.mark.integration


def wait_state(pid: int, state: str, timeout: float = 10.0) -> replies.StatusReply:
    deadline = time.monotonic() + timeout
    last: Optional[replies.StatusReply] = None
    while time.monotonic() < deadline:
        with AgentClient(pid) as c:
            last = c.status()
        if last.state == state:
            return last
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} never reached {state}: {last}")


def test_explicit_start_hello_status_and_socket_permissions(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    sock = runtime_dir / f"{w.pid}.sock"
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(runtime_dir).st_mode) == 0o700
    with AgentClient(w.pid) as c:
        hello = c.hello()
        status = c.status()
    assert hello.pid == w.pid
    assert hello.protocol_version == 1
    assert hello.python.executable == PY
    assert hello.acl.loaded is True
    expected = paths.sim_cann_home() / "lib64" / "libacl_rt.so"
    assert os.path.realpath(hello.acl.library) == os.path.realpath(expected)
    assert hello.acl.cann_version == "9.1.0"
    # Started without the library preloaded: the agent did not see aclrtSetDevice, and a real
    # runtime has no query for "all open devices" -- its LOCK_PRE callback names them at Lock.
    assert hello.acl.devices == () and hello.acl.devices_source is None
    assert hello.restored is False
    assert set(hello.hooks.to_json()) == {"pre_lock", "post_backup", "post_restore", "post_unlock"}
    assert status.state == "RUNNING"
    assert status.lease.active is False
    with AgentClient(w.pid) as c:
        locked = c.lock(30, "test", "app")
        assert locked.callback_devices == (int(workload_env_device(w)),) and locked.no_device is False
        assert c.hello().acl.devices_source == "LOCK_PRE callback"
        assert c.unlock().state == "RUNNING"


def workload_env_device(w: Workload) -> str:
    env = Path(f"/proc/{w.pid}/environ").read_bytes().split(b"\0")
    return next(e for e in env if e.startswith(b"WL_DEVICE=")).split(b"=", 1)[1].decode()


def test_lock_backup_unlock_and_the_job_keeps_computing(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    w.wait_steps(3)
    with AgentClient(w.pid) as c:
        locked = c.lock(lease_s=30)
        assert locked.state == "LOCKED"
        assert locked.lease.active is True
        frozen_at = w.last_step()
        time.sleep(0.5)
        assert w.last_step() <= frozen_at + 1, "device work must block while LOCKED"
        assert c.backup(lease_s=30).state == "BACKED_UP"
        # A second lock is refused by the agent before any device call (lock ownership)
        with pytest.raises(BusyError) as info:
            c.lock()
        assert info.value.details["agent_error"]["name"] == "ALREADY_LOCKED"
        assert info.value.details["owner"]["pid"] == os.getpid()
        unlocked = c.unlock()
        assert unlocked.state == "RUNNING"
        assert unlocked.lease.active is False
    w.wait_steps(5)
    w.assert_correct()


def test_lease_expires_after_the_client_is_killed(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    w.wait_steps(2)
    client = (
        "import os, sys\n"
        "from npusnap_cli.device.agent_client import AgentClient\n"
        f"c = AgentClient({w.pid})\n"
        "r = c.lock(lease_s=1.5)\n"
        "print(r.state, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([PY, "-c", client], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.strip() == "LOCKED"
    status = wait_state(w.pid, "RUNNING", timeout=10)
    assert any("lease" in e and "expired" in e for e in status.events), status.events
    assert "lease of 1.5s expired" in w.agent_log()
    w.wait_steps(5)
    w.assert_correct()


def test_lease_does_not_count_while_the_process_is_stopped(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    with AgentClient(w.pid) as c:
        c.lock(lease_s=1.5)
    # Let the agent finish the request first: time inside an operation is never counted, so a
    # stop that lands there does not even show up as a freeze gap.
    time.sleep(0.2)
    os.kill(w.pid, signal.SIGSTOP)
    time.sleep(2.5)  # longer than the lease: a frozen process must not count it
    os.kill(w.pid, signal.SIGCONT)
    with AgentClient(w.pid) as c:
        status = c.status()
    assert status.state == "LOCKED", status
    assert status.lease.active is True
    assert status.lease.frozen_gaps >= 1
    wait_state(w.pid, "RUNNING", timeout=10)
    w.wait_steps(3)
    w.assert_correct()


def test_renew_and_release(sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    with AgentClient(w.pid) as c:
        c.lock(lease_s=1.0)
        for _ in range(4):  # 2 s in total: only renewals keep it locked
            time.sleep(0.5)
            assert c.renew().state == "LOCKED"
        released = c.release()
        assert released.lease.active is False
        time.sleep(1.5)
        assert c.status().state == "LOCKED"  # no lease: stays locked
        with pytest.raises(AgentDeviceError) as info:
            c.renew()
        assert info.value.name == "NO_LEASE"
        assert c.rollback().actions == ("unlock",)
    w.wait_steps(3)
    w.assert_correct()


def test_hooks_run_in_order_and_a_failing_hook_rolls_back(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    log = tmp_path / "hooks.log"
    fail = tmp_path / "fail"
    w = start_agent_workload(
        sim, runtime_dir, tmp_path, workloads, WL_HOOK_LOG=str(log), WL_HOOK_FAIL_FILE=str(fail)
    )
    with AgentClient(w.pid) as c:
        assert c.hello().hooks.pre_lock == ("__main__.hook_pre_lock",)
        c.lock(lease_s=30)
        c.backup()
        c.unlock()
        assert log.read_text().split() == ["pre_lock", "post_backup", "post_unlock"]

        fail.write_text("pre_lock")
        with pytest.raises(AgentOpError) as info:
            c.lock(lease_s=30)
        err = info.value.error
        assert (err.type, err.hook, err.stage) == ("hook", "__main__.hook_pre_lock", "pre_lock")
        assert "injected failure at pre_lock" in err.exception
        assert c.status().state == "RUNNING"

        fail.write_text("post_backup")
        c.lock(lease_s=30)
        with pytest.raises(AgentOpError) as info:
            c.backup()
        assert info.value.error.stage == "post_backup"
        assert "rolled back to LOCKED" in info.value.error.message
        assert c.status().state == "LOCKED"

        fail.write_text("post_unlock")
        with pytest.raises(AgentOpError):
            c.unlock()
        assert c.status().state == "LOCKED"  # back to what it was before the failed unlock

        fail.write_text("")
        assert c.rollback().state == "RUNNING"
    w.wait_steps(3)
    w.assert_correct()


@requires_root
def test_agent_refuses_another_uid(sim: Sim, tmp_path: Path, workloads: list[Workload]) -> None:
    # The directory (0700) and socket (0600) already keep other users out; open them up here on
    # purpose to prove that SO_PEERCRED is checked too (defence in depth).
    base = Path(tempfile.mkdtemp(prefix="npusnap-peer-", dir="/tmp"))
    try:
        rt = base / "npusnap"
        rt.mkdir(mode=0o700)
        w = start_agent_workload(sim, rt, tmp_path, workloads)
        sock = rt / f"{w.pid}.sock"
        os.chmod(base, 0o711)
        os.chmod(rt, 0o711)
        os.chmod(sock, 0o666)
        client = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
            "try:\n"
            '    s.sendall(b\'{"v":1,"id":1,"op":"hello","args":{}}\\n\')\n'
            "except BrokenPipeError:\n"
            "    pass  # the agent may refuse and close before the request is even sent\n"
            "print(s.recv(4096).decode().strip())\n"
        )
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                client,
                str(sock),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["ok"] is False
        assert answer["error"]["name"] == "PERMISSION_DENIED"
        assert "uid 65534" in w.agent_log()
        with AgentClient(w.pid, socket_path=sock) as c:  # root is still welcome
            assert c.hello().pid == w.pid
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_client_refuses_a_socket_served_by_another_pid(runtime_dir: Path) -> None:
    target = subprocess.Popen(["sleep", "30"])
    try:
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(str(runtime_dir / f"{target.pid}.sock"))
        squatter.listen(1)
        with pytest.raises(AgentError) as info:
            AgentClient(target.pid, connect_retry_s=0)
        assert f"served by pid {os.getpid()}, not by the target pid {target.pid}" in info.value.message
        squatter.close()
    finally:
        target.kill()
        target.wait()


def test_no_agent_says_how_to_get_one(runtime_dir: Path) -> None:
    target = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(AgentError) as info:
            AgentClient(target.pid, connect_retry_s=0)
        assert "has no npusnap agent" in info.value.message
        assert "npusnap run" in info.value.fix and f"npusnap attach {target.pid}" in info.value.fix
    finally:
        target.kill()
        target.wait()


def _socket_inode(path: Path) -> str:
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7] == str(path):
            return fields[6]
    raise AssertionError(f"{path} is not in /proc/net/unix")


def _fd_targets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


@pytest.mark.parametrize(
    ("child_agent", "preload", "child_device"),
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
    ids=["plain-child", "python-started", "preloaded", "preloaded-child-opens-a-device"],
)
def test_forked_child_does_not_serve_the_parents_socket(
    sim: Sim,
    runtime_dir: Path,
    tmp_path: Path,
    workloads: list[Workload],
    child_agent: bool,
    preload: bool,
    child_device: bool,
) -> None:
    """A forked child never serves its parent's socket. Under NPUSNAP_AGENT=1 a preloaded agent
    starts in the child when the child first opens a device (a copy owns none before: nothing to
    snapshot, and no thread of ours in a child that never uses the NPU); an agent started from
    Python without LD_PRELOAD sees no device calls, so it starts in the child at fork."""
    extra = {"WL_FORK": "1"}
    if child_agent:
        extra["NPUSNAP_AGENT"] = "1"
    if preload:
        extra["LD_PRELOAD"] = str(native.library_path(include_mapped=False))
    if child_device:
        extra["WL_FORK_DEVICE"] = "1"
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads, **extra)
    child = int(w.wait_for("child").split()[1])
    try:
        inode = _socket_inode(runtime_dir / f"{w.pid}.sock")
        assert f"socket:[{inode}]" in _fd_targets(w.pid)
        time.sleep(0.3)
        assert f"socket:[{inode}]" not in _fd_targets(child), "the child kept the parent's listener"
        with AgentClient(w.pid) as c:
            assert c.hello().pid == w.pid
        child_sock = runtime_dir / f"{child}.sock"
        if child_device or (child_agent and not preload):
            if child_device:
                w.wait_for("child-device")
            wait_socket(runtime_dir, child)
            with AgentClient(child) as c:
                assert c.hello().pid == child
        else:
            time.sleep(0.3)
            assert not child_sock.exists()
            threads = os.listdir(f"/proc/{child}/task")
            assert threads == [str(child)], f"threads in a child that never opened a device: {threads}"
    finally:
        kill_pid(child)
    assert alive(w.pid)
