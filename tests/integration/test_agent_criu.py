"""A real CRIU dump and restore of a workload whose agent is idle in accept().

The workload is locked and backed up through its agent, the client disconnects (CRIU refuses a
connected stream socket whose peer is outside the tree), `criu dump` kills it, `criu restore`
brings it back with the same pid, and the *restored* agent answers on the re-bound socket,
knows it was restored (lease voided, unlock refused until restore) and carries out Restore and
Unlock, after which the job continues with the right numbers.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from npusnap_cli.agent.launch import agent_library
from npusnap_cli.device.agent_client import AgentClient, AgentDeviceError
from npusnap_cli.errors import BusyError
from tests.conftest import requires_root
from tests.integration.agentlib import (
    BUF,
    PY,
    REPO,
    Sim,
    Workload,
    alive,
    kill_pid,
    wait_socket,
    workload_env,
    write_workload,
)

pytestmark = [pytest.mark.integration, requires_root]
CRIU = "/usr/local/sbin/criu"


def criu(*args: str, log: Path) -> None:
    done = subprocess.run([CRIU, *args, "-o", str(log), "-v4"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        raise AssertionError(f"criu {args[0]} failed ({done.returncode}): {done.stderr}\n" + "\n".join(tail))


@pytest.mark.skipif(
    not os.path.exists(CRIU), reason=f"CRIU is not installed at {CRIU} (scripts/setup.sh builds it)"
)
def test_restored_agent_answers_and_restores_the_device(sim: Sim, runtime_dir: Path, tmp_path: Path) -> None:
    # LD_PRELOAD as `npusnap run` sets it: the agent keeps the device buffer across the snapshot
    # (the simulator, like CANN, gives it back poisoned at Restore).
    env = workload_env(
        sim, runtime_dir, PYTHONPATH=str(REPO), WL_START_AGENT="1", LD_PRELOAD=str(agent_library())
    )
    sim_device = int(env["WL_DEVICE"])
    w = Workload([PY, str(write_workload(tmp_path))], env, tmp_path)
    pid = w.pid
    images = tmp_path / "img"
    images.mkdir()
    try:
        w.wait_for("ready")
        wait_socket(runtime_dir, pid)
        w.wait_steps(3)
        with AgentClient(pid) as c:
            hello = c.hello()
            assert hello.acl.devices == (sim_device,)
            assert hello.acl.devices_source == "aclrtSetDevice (interposed)"
            locked = c.lock(lease_s=60, command="dump").to_json()
            assert locked["state"] == "LOCKED"
            assert locked["callback"] == "registered"
            assert locked["callback_devices"] == [sim_device]  # from npusnap's LOCK_PRE callback
            dm = locked["device_memory"]
            assert dm["interposed"] is True and dm["saved"] is True and dm["saved_bytes"] == BUF
            assert c.backup(lease_s=60).state == "BACKED_UP"
            token = c.token
        dumped_at = w.last_step()

        criu("dump", "-t", str(pid), "-D", str(images), log=images / "dump.log")
        w.proc.wait(10)
        assert not alive(pid)

        criu("restore", "-d", "-D", str(images), log=images / "restore.log")
        assert alive(pid)
        with AgentClient(pid) as c:
            status = c.status().to_json()
            assert status["state"] == "BACKED_UP"
            assert status["restored"] is True
            # The lease restarts in full: a restore command that dies before Unlock is covered.
            assert status["lease"]["active"] is True and status["lease"]["lease_s"] == 60
            assert any("lease of 60s restarted" in e for e in status["events"]), status["events"]
            assert c.hello().pid == pid
            # The owner travelled with the process's memory: without the dump's token, refused.
            assert status["owner"]["command"] == "dump"
            with pytest.raises(BusyError):
                c.restore()
            c.token = token
            with pytest.raises(AgentDeviceError) as info:
                c.unlock()
            assert info.value.name == "RESTORE_REQUIRED"
            assert c.restore().state == "LOCKED"
            unlocked = c.unlock().to_json()
            assert unlocked["state"] == "RUNNING"
            assert unlocked["device_memory"]["steps"] == ["reload device memory", "drop copies"]
            assert unlocked["device_memory"]["gate_closed"] is False
        deadline = time.monotonic() + 20
        while w.last_step() < dumped_at + 5:
            assert time.monotonic() < deadline, f"restored job did not continue: {w.stderr()[-2000:]}"
            time.sleep(0.1)
        w.assert_correct()
    finally:
        kill_pid(pid)


@pytest.mark.parametrize("copy", ["memory", "file"])
def test_lease_finishes_a_restore_that_died_after_criu(
    copy: str, sim: Sim, runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU restored the process, then the restore command died before Restore/Unlock: the
    restarted lease restores the device and unlocks by itself, and the job computes on.

    LD_PRELOAD as `npusnap run` sets it: the simulator, like CANN, gives the device buffer back
    poisoned at Restore, so the job computes on only because the agent saw the buffer being
    allocated, saved it after Lock and writes it back after the lease's Restore and Unlock.
    ``file``: the copy went into a device-memory file (as `npusnap dump` does) and no restore
    command passed it back: the agent opens it by the name the lock recorded."""
    env = workload_env(
        sim, runtime_dir, PYTHONPATH=str(REPO), WL_START_AGENT="1", LD_PRELOAD=str(agent_library())
    )
    w = Workload([PY, str(write_workload(tmp_path))], env, tmp_path)
    pid = w.pid
    images = tmp_path / "img"
    images.mkdir()
    try:
        w.wait_for("ready")
        wait_socket(runtime_dir, pid)
        w.wait_steps(3)
        devmem = tmp_path / "devmem.bin"
        with AgentClient(pid) as c:
            if copy == "file":
                fd = os.open(devmem, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    locked = c.lock(lease_s=4, device_memory_file=(fd, str(devmem)))
                finally:
                    os.close(fd)
            else:
                locked = c.lock(lease_s=4)
            backed = c.backup(lease_s=4).to_json()
        assert bool(backed["device_memory"].get("file_bytes")) == (copy == "file"), (locked, backed)
        if copy == "file":
            assert devmem.stat().st_size == backed["device_memory"]["file_bytes"]
        dumped_at = w.last_step()
        criu("dump", "-t", str(pid), "-D", str(images), log=images / "dump.log")
        w.proc.wait(10)
        criu("restore", "-d", "-D", str(images), log=images / "restore.log")
        # Nobody talks to the agent now (the restore command "died").
        deadline = time.monotonic() + 20
        while w.last_step() < dumped_at + 5:
            assert time.monotonic() < deadline, f"lease did not finish the restore: {w.stderr()[-2000:]}"
            time.sleep(0.1)
        with AgentClient(pid) as c:
            status = c.status().to_json()
        assert status["state"] == "RUNNING" and status["restore_pending"] is False
        assert any("lease rollback done" in e for e in status["events"]), status["events"]
        if copy == "file":
            assert any(str(devmem) in e for e in status["events"]), status["events"]
        dm = status["device_memory"]
        assert dm["saved"] is False and dm["gate_closed"] is False  # reloaded, the gate open
        w.assert_correct()
    finally:
        kill_pid(pid)
